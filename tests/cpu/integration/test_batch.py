"""The batch job (conveyor/cluster/batch/job.py) end to end on a tiny checkpoint:

- input mistakes that fail the job before any work (with the line number);
- 20 lines (2 bad) through a local Ray instance with executor ray: 18 results
  with the HTTP API's body shapes and LLM.generate's greedy tokens, 2 error
  lines; the same file with --data-parallel 2 gives the same results;
- a run killed with SIGKILL half-way, then re-run: every line exactly once;
- the job submitted with `ray job submit --working-dir <repo>` to a
  token-authenticated `ray start --head` instance of its own.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from ray_nodes import free_port, start_node, stop_node, token_env
from repo_paths import ROOT

BIN = os.path.dirname(sys.executable)
COMPLETION_PROMPTS = ["The cat runs", "A dog sees the ball today.", "My friend builds", "日本語の本",
                      "The scheduler", "every token", "Our model reads", "The GPU eats",
                      "Her brother visits", "A small bird", "The teacher writes", "This request"]
CHAT_PROMPTS = ["hello there", "what is a garden?", "tell me a story", "the river", "😀", "again"]


def _write_config(path: str, ckpt: str, executor: str) -> str:
    cfg = {"model": {"path": ckpt, "max_model_len": 1024},
           "parallel": {"executor": executor},
           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 512},
           "cache": {"num_gpu_blocks": 512},
           "serve": {"served_model_name": "tiny"}}
    with open(path, "w") as f:
        json.dump(cfg, f)  # JSON is YAML
    return path


def _line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _twenty_lines() -> list[dict]:
    lines = [_line(f"cmpl-{i}", "/v1/completions",
                   {"model": "tiny", "prompt": p, "max_tokens": 6 + i % 5, "temperature": 0.0})
             for i, p in enumerate(COMPLETION_PROMPTS)]
    lines += [_line(f"chat-{i}", "/v1/chat/completions",
                    {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 8,
                     "temperature": 0.0}) for i, p in enumerate(CHAT_PROMPTS)]
    lines.insert(5, _line("bad-url", "/v1/embeddings", {"model": "tiny", "input": "x"}))
    lines.insert(13, _line("bad-param", "/v1/completions",
                           {"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": -1}))
    # Lines that passed validation and then broke the engine link
    # (it hung the job under `--executor ray`), or that no rerun could write.
    for i, (cid, extra) in enumerate(BAD_VALUES.items()):
        lines.insert(3 + 4 * i, _line(cid, "/v1/completions", {"model": "tiny", "prompt": "x",
                                                                 "max_tokens": 4, **extra}))
    lines.insert(9, _line("bad-\udc00", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4}))
    assert len(lines) == N_LINES
    return lines


# custom_id -> (the body's extra field, the param its 400 names)
BAD_VALUES = {"bad-stop": {"stop": ["\udc00"]}, "bad-top-k": {"top_k": 2**64},
              "bad-stop-ids": {"stop_token_ids": [2**70]}, "bad-prompt": {"prompt": "x\udc00"}}
N_LINES = 25


def _write_jsonl(path: str, objs: list[dict]) -> str:
    # backslashreplace: a lone surrogate goes as its JSON escape (\udc00), as a client sends it.
    with open(path, "wb") as f:
        f.write("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in objs)
                .encode("utf-8", "backslashreplace"))
    return path


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def refs(ckpt):
    """LLM.generate's greedy texts for every good line, keyed by custom_id."""
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(model=ckpt, max_model_len=1024)
    try:
        tok = llm.tokenizer
        out = {}
        for line in _twenty_lines():
            body = line["body"]
            if line["custom_id"].startswith("cmpl-"):
                prompt = body["prompt"]
            elif line["custom_id"].startswith("chat-"):
                prompt = tok.encode(tok.apply_chat_template(body["messages"]), add_special_tokens=False)
            else:
                continue
            sp = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0)
            ids = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
            # The full decode of the greedy tokens: what the HTTP API returns
            # (a request cut mid-character ends in U+FFFD there).
            out[line["custom_id"]] = tok.decode(ids)
        return out
    finally:
        llm.shutdown()


def _check_results(path: str, refs: dict[str, str]) -> None:
    records = _read_jsonl(path)
    assert len(records) == N_LINES and len({r["custom_id"] for r in records}) == N_LINES
    assert len({r["id"] for r in records}) == N_LINES
    errors = {r["custom_id"]: r for r in records if r["error"] is not None}
    assert set(errors) == {"bad-url", "bad-param", "bad-\udc00", *BAD_VALUES}
    assert errors["bad-url"]["response"]["status_code"] == 400
    assert errors["bad-url"]["error"]["code"] == "invalid_url"
    assert errors["bad-param"]["response"]["body"]["error"]["param"] == "temperature"
    params = {"bad-stop": "stop", "bad-top-k": "top_k", "bad-stop-ids": "stop_token_ids",
              "bad-prompt": "prompt", "bad-\udc00": "custom_id"}
    for cid, param in params.items():
        assert errors[cid]["response"]["status_code"] == 400, errors[cid]
        assert errors[cid]["response"]["body"]["error"]["param"] == param, errors[cid]
    for r in records:
        if r["error"] is not None:
            continue
        resp, body = r["response"], r["response"]["body"]
        assert resp["status_code"] == 200 and body["id"].endswith(resp["request_id"])
        chat = r["custom_id"].startswith("chat-")
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert body["model"] == "tiny" and body["usage"]["completion_tokens"] > 0
        choice = body["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        assert text == refs[r["custom_id"]], r["custom_id"]


# ---- job-level input errors (no engine starts) ---------------------------------------------

@pytest.mark.parametrize("content, message", [
    ('{"custom_id": "a", "url": "/v1/completions", "body": {}}\n{"url": "/v1/completions"}\n',
     "in.jsonl:2: missing custom_id"),
    ('{"custom_id": "a"}\n\n{"custom_id": "b", \n', "in.jsonl:3: not valid JSON"),
    ('{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "a"}\n',
     "in.jsonl:3: duplicate custom_id 'a' (first on line 1)"),
    ('[1, 2]\n', "in.jsonl:1: expected a JSON object"),
])
def test_bad_input_fails_before_any_work(tmp_path, ckpt, capsys, content, message):
    from conveyor.cluster.batch.job import main

    (tmp_path / "in.jsonl").write_text(content)
    cfg = _write_config(str(tmp_path / "c.yaml"), ckpt, "uniproc")
    out = tmp_path / "out.jsonl"
    rc = main(["--config", cfg, "--input", str(tmp_path / "in.jsonl"), "--output", str(out)])
    assert rc == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_empty_input_gives_empty_output(tmp_path, ckpt):
    from conveyor.cluster.batch.job import main

    (tmp_path / "in.jsonl").write_text("\n")
    cfg = _write_config(str(tmp_path / "c.yaml"), ckpt, "ray")  # never started: nothing to do
    out = tmp_path / "out.jsonl"
    assert main(["--config", cfg, "--input", str(tmp_path / "in.jsonl"), "--output", str(out)]) == 0
    assert out.read_bytes() == b""


def test_bad_config_names_the_key(tmp_path, ckpt, capsys):
    from conveyor.cluster.batch.job import main

    _write_jsonl(str(tmp_path / "in.jsonl"), _twenty_lines()[:1])
    cfg = _write_config(str(tmp_path / "c.yaml"), ckpt, "uniproc")
    rc = main(["--config", cfg, "--input", str(tmp_path / "in.jsonl"), "--output",
               str(tmp_path / "o.jsonl"), "--set", "scheduler.max_num_seqs=0"])
    assert rc == 2 and "scheduler.max_num_seqs: expected int >= 1, got 0" in capsys.readouterr().err


def test_both_data_parallel_knobs_at_once_are_refused(tmp_path, ckpt, capsys):
    from conveyor.cluster.batch.job import main

    _write_jsonl(str(tmp_path / "in.jsonl"), _twenty_lines()[:1])
    cfg = _write_config(str(tmp_path / "c.yaml"), ckpt, "uniproc")
    out = tmp_path / "o.jsonl"
    rc = main(["--config", cfg, "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
               "--data-parallel", "2", "--set", "parallel.data_parallel_size=2"])
    err = capsys.readouterr().err
    assert rc == 2 and "--data-parallel 2 with parallel.data_parallel_size 2: choose one" in err, err
    assert not out.exists()


# ---- through Ray: executor ray, then two data-parallel engines ----------------------------------

def test_batch_on_ray_executor_and_data_parallel(tmp_path, ckpt, refs):
    import ray

    from conveyor.cluster.batch.job import main

    inp = _write_jsonl(str(tmp_path / "in.jsonl"), _twenty_lines())
    cfg = _write_config(str(tmp_path / "c.yaml"), ckpt, "ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        out1 = str(tmp_path / "out1.jsonl")
        assert main(["--config", cfg, "--input", inp, "--output", out1, "--no-progress"]) == 0
        _check_results(out1, refs)
        out2 = str(tmp_path / "out2.jsonl")
        assert main(["--config", cfg, "--input", inp, "--output", out2, "--no-progress",
                     "--data-parallel", "2", "--max-in-flight", "3"]) == 0
        _check_results(out2, refs)
        # Each engine journaled its tokens (conveyor/cluster/batch/token_journal.py); a finished job keeps none.
        assert not [f for f in os.listdir(tmp_path) if ".tokens" in f]
        # A finished output makes a re-run a no-op (nothing is repeated).
        before = open(out2, "rb").read()
        assert main(["--config", cfg, "--input", inp, "--output", out2, "--no-progress"]) == 0
        assert open(out2, "rb").read() == before
    finally:
        ray.shutdown()


# ---- kill -9 half-way, then resume ------------------------------------------------------------

def test_killed_run_resumes_without_repeats(tmp_path, ckpt):
    from conveyor.cluster.batch.job import main

    lines = [_line(f"k{i}", "/v1/completions",
                   {"model": "tiny", "prompt": COMPLETION_PROMPTS[i % 12], "max_tokens": 200,
                    "temperature": 0.0, "ignore_eos": True}) for i in range(20)]
    inp = _write_jsonl(str(tmp_path / "in.jsonl"), lines)
    cfg = _write_config(str(tmp_path / "c.yaml"), ckpt, "uniproc")
    out = tmp_path / "out.jsonl"
    args = ["--config", cfg, "--input", inp, "--output", str(out), "--no-progress", "--max-in-flight", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cluster.batch", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 4:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"finished before the kill: {proc.stderr.read().decode()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    done = out.read_bytes()
    complete = done[:done.rfind(b"\n") + 1]
    n_before = complete.count(b"\n")
    assert 4 <= n_before < 20
    with open(out, "ab") as f:  # what a kill in the middle of a write leaves behind
        f.write(b'{"id": "batch_req_cut", "custom_id": "k1')
    assert main(args) == 0
    after = out.read_bytes()
    assert after.startswith(complete)  # finished lines are kept as they were
    records = _read_jsonl(str(out))
    ids = [r["custom_id"] for r in records]
    assert sorted(ids) == sorted(ln["custom_id"] for ln in lines)  # each exactly once
    assert all(r["error"] is None and r["response"]["body"]["usage"]["completion_tokens"] == 200
               for r in records)


# ---- ray job submit against a token-authenticated cluster of our own -----------------------

def _wait_for_job_server(url: str, token: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "ray start exited"
        try:
            req = urllib.request.Request(f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise AssertionError("the job server did not come up")


def _submit_when_agent_is_up(submit: list[str], env: dict[str, str],
                             timeout: float = 90) -> subprocess.CompletedProcess:
    """`ray job submit`, again while the head answers that its job agent is not
    up yet (the job API comes up before the agent on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while True:
        r = subprocess.run(submit, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        if r.returncode == 0 or "No available agent" not in r.stderr or time.monotonic() > deadline:
            return r
        time.sleep(2)


def test_ray_job_submit(tmp_path, ckpt, refs):
    token = secrets.token_hex(32)
    env = token_env(token)
    temp_dir = tempfile.mkdtemp(prefix="cvray", dir="/tmp")  # short: Unix socket paths
    dash = free_port()
    ports = {"--port": free_port(), "--dashboard-port": dash, "--ray-client-server-port": free_port()}
    head = start_node(env, ["--head", "--dashboard-host", "127.0.0.1", "--num-cpus", "4",
                            "--include-dashboard", "true", "--temp-dir", temp_dir,
                            *[x for k, v in ports.items() for x in (k, str(v))]], cwd=ROOT)
    address = f"http://127.0.0.1:{dash}"
    try:
        _wait_for_job_server(address, token, head)
        inp = _write_jsonl(str(tmp_path / "in.jsonl"), _twenty_lines())
        cfg = _write_config(str(tmp_path / "c.yaml"), ckpt, "ray")
        out = str(tmp_path / "out.jsonl")
        job_id = f"conveyor-batch-{secrets.token_hex(4)}"
        submit = [os.path.join(BIN, "ray"), "job", "submit", "--address", address, "--working-dir", ROOT,
                  "--submission-id", job_id, "--no-wait", "--",
                  "python", "-m", "conveyor.cluster.batch", "--config", cfg, "--input", inp, "--output", out,
                  "--no-progress"]
        r = _submit_when_agent_is_up(submit, env)
        assert r.returncode == 0, r.stdout + r.stderr
        status = _wait_for_job(address, job_id, token)
        if status != "SUCCEEDED":
            logs = subprocess.run([os.path.join(BIN, "ray"), "job", "logs", "--address", address, job_id],
                                  env=env, capture_output=True, text=True, timeout=60).stdout
            pytest.fail(f"job {job_id} ended {status}:\n{logs[-4000:]}")
        _check_results(out, refs)
    finally:
        stop_node(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_job(address: str, job_id: str, token: str, timeout: float = 150) -> str:
    """The job's terminal status, from the job server's REST API."""
    import urllib.request

    deadline = time.monotonic() + timeout
    status = "UNKNOWN"
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"{address}/api/jobs/{job_id}",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            status = json.loads(resp.read())["status"]
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(1)
    return f"not finished after {timeout:.0f}s (last: {status})"
