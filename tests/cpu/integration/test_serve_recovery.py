"""Serve recovery: a worker rank killed mid-stream costs no
request. 24 concurrent streams (half greedy, half seeded at temperature 0.8)
through the OpenAI HTTP app, executor "ray" with TP=2 inside the replica's
placement group; SIGKILL one RayWorkerActor a third of the way through: every
stream ends with [DONE] and finish_reason "length", its text and token count
equal an undisturbed run's, no error event, KV usage returns to 0 and /health
answers 200 afterwards. (The EngineCoreActor's own death is tested elsewhere.)"""
from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
from ray_nodes import worker_actor_pids
from sse_utils import DONE, sse_events

from conveyor.parallel.ports import free_port

NUM_STREAMS, MAX_TOKENS = 24, 48
PROMPTS = ["The cat runs", "A dog sees the ball today.", "My friend builds", "日本語の本"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    import ray
    from ray import serve

    from conveyor.cluster.serve_app import run_serve

    tmp = tmp_path_factory.mktemp("serve_rec")
    ckpt = tiny_llama
    cfg = {"model": {"path": ckpt, "max_model_len": 512},
           "parallel": {"executor": "ray", "tensor_parallel_size": 2},
           "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 512},
           "cache": {"num_gpu_blocks": 512},
           "serve": {"host": "127.0.0.1", "port": free_port(), "served_model_name": "tiny",
                     "metrics_public": True}}
    path = str(tmp / "engine.yaml")
    with open(path, "w") as f:
        json.dump(cfg, f)  # JSON is YAML
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        yield run_serve(path, blocking=False)
    finally:
        serve.shutdown()
        ray.shutdown()


def _worker_pids() -> set[int]:
    """RayWorkerActor processes of this test's Ray (descendants of this process)."""
    return set(worker_actor_pids())


def _metric(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.split("{", 1)[0].split(" ", 1)[0] == name)


async def _stream(c: httpx.AsyncClient, i: int, progress: asyncio.Queue) -> dict:
    body = {"prompt": f"{PROMPTS[i % 4]} {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "logprobs": 0, "stream": True,
            **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i})}
    out = {"text": "", "tokens": 0, "finish": None, "done": False, "errors": []}
    async for ev in sse_events(c, "/v1/completions", body):
        if ev is DONE:
            out["done"] = True
            continue
        if "error" in ev:
            out["errors"].append(ev)
            continue
        ch = ev["choices"][0]
        out["text"] += ch["text"]
        n = len(ch["logprobs"]["tokens"])
        out["tokens"] += n
        out["finish"] = ch["finish_reason"] or out["finish"]
        progress.put_nowait(n)
    return out


async def _run_streams(url: str, kill_after_tokens: int | None) -> tuple[list[dict], int | None]:
    """24 concurrent streams; SIGKILL one worker rank once `kill_after_tokens`
    tokens have arrived in total (None: undisturbed). Returns the streams and the killed pid."""
    progress: asyncio.Queue[int] = asyncio.Queue()
    killed: int | None = None

    async def killer() -> None:
        nonlocal killed
        seen = 0
        while seen < kill_after_tokens:
            seen += await progress.get()
        killed = sorted(_worker_pids())[-1]
        os.kill(killed, signal.SIGKILL)

    limits = httpx.Limits(max_connections=NUM_STREAMS)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as c:
        task = asyncio.create_task(killer()) if kill_after_tokens is not None else None
        outs = await asyncio.wait_for(
            asyncio.gather(*(_stream(c, i, progress) for i in range(NUM_STREAMS))), 240)
        if task is not None:
            assert task.done(), "the kill never happened"
            await task
    return outs, killed


def _wait_idle(url: str, timeout_s: float = 30.0) -> str:
    """/metrics once the engine runs nothing and holds no KV (a tiny request
    makes it step once more, since the gauges are per step)."""
    import time

    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
        text = httpx.get(f"{url}/metrics").text
        if (_metric(text, "conveyor:num_requests_running") == 0
                and _metric(text, "conveyor:kv_cache_usage_perc") == 0.0):
            return text
        time.sleep(0.2)
    raise AssertionError("engine did not go idle")


def _wait_health_ok(url: str, timeout_s: float = 60.0) -> tuple[int, dict]:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{url}/health", timeout=30)
        got = (r.status_code, r.json())
        if got == (200, {"status": "ok"}) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_killed_worker_rank_costs_no_stream(server):
    ref, _ = asyncio.run(_run_streams(server, None))
    before = _worker_pids()
    assert len(before) == 2, before
    got, killed = asyncio.run(_run_streams(server, NUM_STREAMS * MAX_TOKENS // 3))
    after = _worker_pids()

    assert all(o["done"] and not o["errors"] for o in got), [o for o in got if o["errors"]][:2]
    assert [o["finish"] for o in got] == ["length"] * NUM_STREAMS
    assert [o["tokens"] for o in got] == [MAX_TOKENS] * NUM_STREAMS  # none duplicated or missing
    assert [o["text"] for o in got] == [o["text"] for o in ref]
    assert killed in before and killed not in after and len(after) == 2
    metrics = _wait_idle(server)
    assert _metric(metrics, "conveyor:engine_restarts_total") == 1
    assert _metric(metrics, "conveyor:engine_recovery_seconds_count") == 1
    # /health reads "recovering" also while the engine actor is slow to answer
    # its health call (a loaded 2-core box): it must settle on "ok", and with
    # no second restart behind it.
    assert _wait_health_ok(server) == (200, {"status": "ok"})
    assert _metric(httpx.get(f"{server}/metrics").text, "conveyor:engine_restarts_total") == 1
