"""The `conveyor` CLI as users run it (`python -m conveyor.cluster.cli`, a subprocess
each): --help texts list every option with the config key it overrides,
`config validate` on good and bad files, `generate` on a tiny checkpoint
(greedy tokens equal LLM.generate's), `bench` dispatch, `serve` until
SIGINT, and the `make run` demo (python -m conveyor.cluster.demo) end to end."""
from __future__ import annotations

import ast
import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from repo_paths import ROOT

from conveyor.cluster.cli.options import ENGINE_OVERRIDES, SERVE_OVERRIDES
from conveyor.parallel.ports import free_port

PROMPTS = ["The cat runs", "日本語の本"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conveyor.cluster.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _flat(text: str) -> str:
    return " ".join(text.split())  # argparse wraps help lines


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_llama):
    """(checkpoint, engine config YAML pointing at it)."""
    base = tmp_path_factory.mktemp("cli")
    ckpt = tiny_llama
    cfg = str(base / "tiny.yaml")
    with open(cfg, "w") as f:
        json.dump({"model": {"path": ckpt, "max_model_len": 512},
                   "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
                   "cache": {"num_gpu_blocks": 256},
                   "serve": {"host": "127.0.0.1", "port": free_port(), "served_model_name": "tiny"}}, f)
    return ckpt, cfg


# ---- help ---------------------------------------------------------------------------------

@pytest.mark.parametrize("command, overrides", [
    (["serve"], SERVE_OVERRIDES + ENGINE_OVERRIDES),
    (["generate"], ENGINE_OVERRIDES),
    (["batch"], ENGINE_OVERRIDES),
])
def test_help_lists_every_option_and_the_key_it_overrides(command, overrides):
    r = cli(*command, "--help")
    assert r.returncode == 0, r.stderr
    text = _flat(r.stdout)
    for o in overrides:
        assert f"{o.flag} " in text and f"overrides {o.key}" in text, o.flag
    assert "--set KEY.PATH=VALUE" in text


def test_help_of_the_other_commands():
    top = cli("--help")
    assert top.returncode == 0
    for name in ("serve", "generate", "batch", "bench", "config"):
        assert name in top.stdout
    assert "--max-tokens" in cli("generate", "--help").stdout  # sampling options too
    batch = _flat(cli("batch", "--help").stdout)
    for flag in ("--config", "--input", "--output", "--data-parallel", "--max-in-flight", "--no-progress"):
        assert flag in batch
    bench = cli("bench", "--help")
    assert bench.returncode == 0 and all(n in bench.stdout for n in ("scheduler", "offline", "serve"))
    assert "--gpus" in cli("config", "validate", "--help").stdout


def test_bench_dispatches_to_the_script():
    r = cli("bench", "scheduler", "--help")
    assert r.returncode == 0 and "usage: scheduler.py" in r.stdout


# ---- config validate --------------------------------------------------------------------------

def test_config_validate_good_and_bad(tmp_path):
    files = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    r = cli("config", "validate", *files)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok ") == len(files)
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler:\n  max_num_seqs: ten\n")
    r = cli("config", "validate", files[0], str(bad))
    assert r.returncode == 1
    assert f'{bad}: scheduler.max_num_seqs: expected int >= 1, got "ten"' in r.stdout
    r = cli("config", "validate", "configs/tiny-cpu.yaml", "--set", "cache.block_size=12")
    assert r.returncode == 1 and "cache.block_size: expected one of 8/16/32/64/128, got 12" in r.stdout
    r = cli("config", "validate", "configs/llama3-70b-tp4-pp2.yaml", "--gpus", "4")
    assert r.returncode == 1 and "expected at most the cluster's 4 GPUs" in r.stdout


# ---- generate ---------------------------------------------------------------------------------

def test_generate_matches_llm(tiny):
    from conveyor.engine import LLM, SamplingParams

    ckpt, cfg = tiny
    r = cli("generate", cfg, *[x for p in PROMPTS for x in ("--prompt", p)], "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    llm = LLM(model=ckpt, max_model_len=512)
    try:
        ref = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [g["token_ids"] for g in got] == [list(o.outputs[0].token_ids) for o in ref]
    assert [g["prompt"] for g in got] == PROMPTS and all(g["finish_reason"] == "length" for g in got)
    plain = cli("generate", cfg, "--prompt", PROMPTS[0], "--max-tokens", "4", "--chat",
                "--max-num-seqs", "4")
    assert plain.returncode == 0 and plain.stdout.strip()


def test_generate_and_serve_reject_bad_input_before_starting(tiny):
    _, cfg = tiny
    r = cli("generate", cfg, "--prompt", "x", "--temperature", "-1")
    assert r.returncode == 2 and "temperature" in r.stderr
    r = cli("serve", cfg, "--port", "0")
    assert r.returncode == 2 and "serve.port: expected int in 1..65535, got 0 (from an override)" in r.stderr
    r = cli("generate", cfg, "--prompt", "x", "--set", "nodots=1")
    assert r.returncode == 2 and "expected SECTION.KEY=VALUE" in r.stderr


# ---- serve and the demo (each starts its own local Ray instance) ----------------------------------

def _post_chat(url: str, max_tokens: int = 4) -> dict:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.ray  # in the `conveyor` process it starts
def test_serve_prints_the_url_and_stops_on_sigint(tiny):
    """`conveyor serve` starts Ray itself, so direct ingress is on by default
    (serve.direct_ingress null): the proxy URL and the replica's own URL (no proxy
    hop) both answer."""
    _, cfg = tiny
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cluster.cli", "serve", cfg, "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("direct ingress" in ln for ln in lines):
            lines.append(proc.stdout.readline())
            assert lines[-1] or proc.poll() is None, f"conveyor serve exited early: {lines}"
        url = f"http://127.0.0.1:{port}/v1"
        assert any(f"Serving 'tiny' at {url}" in ln for ln in lines), lines
        direct = lines[-1].split(": ", 1)[1].strip()
        assert direct.startswith("http://127.0.0.1:") and direct != url, lines
        for u in (url, direct):
            reply = _post_chat(u)
            assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session only
            proc.wait(timeout=30)
        proc.stdout.close()


@pytest.mark.ray  # in the `conveyor` process it starts
def test_demo_builds_the_model_serves_and_answers(tmp_path):
    cfg = tmp_path / "demo.yaml"
    with open(os.path.join(ROOT, "configs", "tiny-cpu.yaml")) as f:
        text = f.read()
    cfg.write_text(text.replace("path: demo_model", f"path: {tmp_path / 'demo_model'}"))
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "conveyor.cluster.demo", "--config", str(cfg), "--port", str(port),
                        "--max-tokens", "6"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert f"built the demo checkpoint in {tmp_path / 'demo_model'}" in r.stdout
    assert f"serving 'tiny' at http://127.0.0.1:{port}/v1" in r.stdout
    assert "assistant:" in r.stdout and "'completion_tokens': 6" in r.stdout and "shut down." in r.stdout
    # The committed demo model was trained on English (the stdlib's docstrings): it answers in words.
    answer = ast.literal_eval(r.stdout.split("assistant: ", 1)[1].splitlines()[0])
    words = answer.lower().split()
    assert len(words) >= 3 and all(w.strip(".,;:'\"()").isalpha() for w in words), answer
    assert {"the", "a", "an", "of", "is", "to", "and", "return", "returns"} & set(words), answer
