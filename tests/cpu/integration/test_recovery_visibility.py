"""Recovery as an operator sees it and a wedged rank.

- While a lost worker group is rebuilt, /health answers 200 {"status":
  "recovering"}, a new request queues and then completes, and afterwards
  /metrics shows conveyor:engine_restarts_total and
  conveyor:engine_recovery_seconds; the log names the dead rank, its node
  and the cause. Past the restart budget every in-flight request ends
  "error" within 30 s and /health fails.
- A SIGSTOPped rank (alive, silent) is detected by parallel.step_timeout_s and
  recovered like a dead one: same tokens as an undisturbed run.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import httpx
import pytest
from llm_utils import pid_alive, random_prompts
from recovery_utils import before_step, drain_all, greedy_and_seeded, undisturbed_tokens

import conveyor.engine.core.engine_core
from conveyor.engine import LLM

PROMPTS = random_prompts(4, 5, 40, seed=13)
PARAMS = greedy_and_seeded(4, max_tokens=48, temperature=0.8, seed=70)


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def reference(ckpt):
    return undisturbed_tokens(ckpt, PROMPTS, PARAMS, max_num_batched_tokens=64, max_model_len=512)


def _metric(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(name + "{") or ln.startswith(name + " "))


class _Gate:
    """Holds the rebuild of the worker group until released, so the test sees
    the engine while it recovers (an event, not a sleep)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        real = conveyor.engine.core.engine_core.rebuild_executor

        def gated(*args):
            self.entered.set()
            self.release.wait(120)
            return real(*args)
        monkeypatch.setattr(conveyor.engine.core.engine_core, "rebuild_executor", gated)


def test_health_metrics_and_logs_during_and_after_recovery(ckpt, reference, monkeypatch, caplog):
    import conveyor.cluster.openai.server as server_mod
    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    monkeypatch.setattr(server_mod, "HEALTH_TTL_S", 0.0)  # every probe asks the engine
    caplog.set_level(logging.WARNING, logger="conveyor.engine.core.engine_core")
    gate = _Gate(monkeypatch)
    cfg = build_config({"model": {"path": ckpt, "max_model_len": 512},
                        "parallel": {"executor": "mp", "tensor_parallel_size": 2, "max_restarts": 1},
                        "scheduler": {"max_num_batched_tokens": 64},
                        "serve": {"served_model_name": "tiny", "metrics_public": True}})

    async def scenario() -> dict:
        llm = AsyncLLM(cfg)
        srv = OpenAIServer(llm, cfg)
        await srv.start()
        seen: dict = {}
        transport = httpx.ASGITransport(app=build_api(srv, api_key=None))
        loop = asyncio.get_running_loop()
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
                streams = [llm.generate(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
                firsts = [await s.__anext__() for s in streams]
                seen["killed"] = victim = llm.worker_pids()[1]
                os.kill(victim, signal.SIGKILL)
                assert await loop.run_in_executor(None, gate.entered.wait, 60)
                r = await c.get("/health")
                seen["during"] = (r.status_code, r.json())
                # A request that arrives now queues (within admission) and runs after the rebuild.
                late = asyncio.create_task(c.post("/v1/completions", json={
                    "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}))
                await asyncio.sleep(0)
                gate.release.set()
                seen["outs"] = await drain_all(firsts, streams, timeout_s=120)
                r = await late
                seen["late"] = (r.status_code, r.json()["choices"][0]["finish_reason"])
                r = await c.get("/health")
                seen["after"] = (r.status_code, r.json())
                seen["metrics"] = (await c.get("/metrics")).text
                seen["pids_after"] = llm.worker_pids()

                # The budget (1) is spent: the next loss fails every in-flight stream, within 30 s.
                streams = [llm.generate(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
                firsts = [await s.__anext__() for s in streams]
                os.kill(llm.worker_pids()[0], signal.SIGKILL)
                seen["failed"] = await drain_all(firsts, streams, timeout_s=30)
                r = await c.get("/health")
                seen["dead"] = r.status_code
        finally:
            await llm.shutdown()
        return seen

    seen = asyncio.run(scenario())
    assert seen["during"] == (200, {"status": "recovering"})
    assert seen["late"] == (200, "length")
    assert seen["after"] == (200, {"status": "ok"})
    assert [r for _, r in seen["outs"]] == ["length"] * 4
    assert [t for t, _ in seen["outs"]] == reference
    assert seen["killed"] not in seen["pids_after"] and len(seen["pids_after"]) == 2
    m = seen["metrics"]
    assert _metric(m, "conveyor:engine_restarts_total") == 1
    assert _metric(m, "conveyor:engine_recovery_seconds_count") == 1
    assert _metric(m, "conveyor:engine_recovery_seconds_sum") > 0
    failed = [r.getMessage() for r in caplog.records if "worker group failed" in r.getMessage()]
    assert failed and "rank 1 on node" in failed[0] and f"pid {seen['killed']}" in failed[0], failed
    assert "killed by SIGKILL" in failed[0], failed
    assert any("restart budget spent" in msg for msg in failed), failed
    assert [r for _, r in seen["failed"]] == ["error"] * 4
    assert seen["dead"] == 503


def _stop_rank_at_step(llm: LLM, rank: int, step: int) -> list[tuple[int, float]]:
    """SIGSTOP `rank` before engine step `step`; returns [(pid, when)]."""
    stopped: list[tuple[int, float]] = []

    def stop() -> None:
        pid = llm.worker_pids()[rank]
        os.kill(pid, signal.SIGSTOP)
        stopped.append((pid, time.monotonic()))
    before_step(llm, step, stop)
    return stopped


def test_sigstopped_rank_is_detected_by_step_timeout_and_recovered(ckpt, reference, caplog):
    timeout_s = 4.0
    caplog.set_level(logging.WARNING, logger="conveyor.engine.core.engine_core")
    llm = LLM(model=ckpt, executor="mp", tensor_parallel_size=2, max_num_batched_tokens=64,
              max_model_len=512, **{"parallel.step_timeout_s": timeout_s})
    stopped: list[tuple[int, float]] = []
    try:
        stopped = _stop_rank_at_step(llm, 1, 8)
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        after = llm.worker_pids()
        restarts = llm.engine.num_restarts
    finally:
        llm.shutdown()
        for pid, _ in stopped:  # leave nothing stopped behind
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
    assert len(stopped) == 1 and restarts == 1
    pid, t_stop = stopped[0]
    assert pid not in after and not pid_alive(pid)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
    assert [o.outputs[0].token_ids for o in outs] == reference
    failed = [r for r in caplog.records if "worker group failed" in r.getMessage()]
    assert len(failed) == 1
    msg = failed[0].getMessage()
    assert "rank 1 is stopped" in msg and "parallel.step_timeout_s" in msg and "rank 1 on node" in msg, msg
    # Detected by the step bound (the receiver polls every 0.2 s), not by anything slower.
    # record.created is wall-clock time: compare it with the wall-clock time of the stop.
    detected_after = failed[0].created - (time.time() - (time.monotonic() - t_stop))
    assert detected_after < timeout_s + 2.0, detected_after
