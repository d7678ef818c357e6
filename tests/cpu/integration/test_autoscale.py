"""Engines scaled and rolled over while serving (conveyor/engine/dp/scale_policy.py,
conveyor/engine/dp/scaling.py, conveyor/engine/dp/reload_plan.py, POST /admin/reload).

- The policy: bounds first, each move only after its whole delay, the clock
  restarted by a break in the signal, by a move and by a busy cluster, and a
  scale-down never leaves a load that asks straight back up.
- The mechanism without engines: a new slot the router routes to, an emptied
  slot shown "off" and reused, a rollout of one engine that starts its
  successor first, the autoscaler acting on the policy's clock.
- Two in-process engines with greedy and seeded streams in flight: a reload
  over HTTP of a changed scheduler.max_num_seqs (engine by engine, each
  drained through migration first), then scale 2 -> 1 and back to 2. Every
  stream ends normally with the tokens and text of an undisturbed run.
"""
from __future__ import annotations

import asyncio
import random
import threading

import msgspec
import pytest
from recovery_utils import FakeFrontend

from conveyor.engine import SamplingParams
from conveyor.engine.dp.scale_policy import EngineLoad, LoadSnapshot, ScalePolicy, ScaleSettings, wanted


def _snap(*waiting: int, running: int = 0, kv: float = 0.0, cap: int = 8, busy: bool = False) -> LoadSnapshot:
    return LoadSnapshot(tuple(EngineLoad(w, running, kv, cap) for w in waiting), busy)


def test_policy_bounds_delays_and_restarts() -> None:
    s = ScaleSettings(min_engines=2, max_engines=4, target_waiting=2.0, upscale_delay_s=10.0,
                      downscale_delay_s=30.0)
    p = ScalePolicy(s)
    assert p.decide(_snap(0), 0.0) == 2  # below min: at once
    assert p.decide(_snap(0, 0, 0, 0, 0), 0.0) == 4  # above max: at once
    hot = _snap(5, 5)
    assert [p.decide(hot, t) for t in (0.0, 9.9, 10.0)] == [2, 2, 3]
    assert p.decide(hot, 10.5) == 2  # the clock restarts after a move
    assert p.decide(_snap(5, 5, busy=True), 30.0) == 2  # busy: hold, and restart
    assert [p.decide(hot, t) for t in (31.0, 40.0, 41.0)] == [2, 2, 3]
    p.decide(hot, 50.0)
    p.decide(_snap(2, 2), 55.0)  # the signal broke (mean 2 is not past the target)
    assert p.decide(hot, 59.0) == 2 and p.decide(hot, 69.0) == 3
    assert p.decide(_snap(9, 9, 9, 9), 0.0) == 4  # at max: hold
    idle = _snap(0, 0, 0, running=1)
    assert [p.decide(idle, t) for t in (100.0, 129.0, 130.0)] == [3, 3, 2]
    assert ScalePolicy(s).decide(_snap(0, 0, running=1), 1e9) == 2  # at min: hold


def test_policy_signals_and_no_flapping() -> None:
    s = ScaleSettings(min_engines=1, max_engines=8, target_waiting=2.0)
    assert wanted(s, _snap(0, 0, running=2).engines) == -1  # 4 running fill half of one engine's 8 slots
    assert wanted(s, _snap(0, 0, running=3).engines) == 0
    assert wanted(s, _snap(1, 0, running=0).engines) == 0  # something waits: never down
    assert wanted(s, _snap(3, 2).engines) == 1
    kv = ScaleSettings(min_engines=1, max_engines=8, signal="kv_usage", target_kv_usage=0.8)
    assert wanted(kv, _snap(0, 0, kv=0.9).engines) == 1
    assert wanted(kv, _snap(0, 0, kv=0.2).engines) == -1 and wanted(kv, _snap(0, 0, kv=0.3).engines) == 0
    rng = random.Random(0)
    for _ in range(2000):  # the load a scale-down leaves never asks for an engine back
        n, cap = rng.randint(2, 8), rng.choice([1, 4, 16])
        running, used = rng.randint(0, n * cap), rng.uniform(0, n)
        for st in (s, kv):
            load = tuple(EngineLoad(0, running // n, used / n, cap) for _ in range(n))
            if wanted(st, load) == -1:
                after = tuple(EngineLoad(0, running // (n - 1), used / (n - 1), cap) for _ in range(n - 1))
                assert wanted(st, after) != 1, (st.signal, n, cap, running, used)


def test_reload_plan_refuses_a_changed_model_and_frontend_keys() -> None:
    from conveyor.engine.config import build_config
    from conveyor.engine.dp.reload_plan import plan_reload

    old = build_config(data_parallel_size=2, max_engines=3)
    new = build_config(data_parallel_size=2, max_engines=4, max_num_seqs=8)
    plan = plan_reload(old, new)
    assert plan.engine_keys == ("scheduler.max_num_seqs",) and plan.scale_keys == ("serve.max_engines",)
    with pytest.raises(ValueError, match=r"the model changed \(model.seed\)"):
        plan_reload(old, build_config(data_parallel_size=2, max_engines=3, seed=1))
    with pytest.raises(ValueError, match="serve.port cannot change"):
        plan_reload(old, build_config(data_parallel_size=2, max_engines=3, **{"serve.port": 9}))


# ---- the mechanism, without engines ----------------------------------------------------

def _req(rid: str):
    from conveyor.engine.contracts import EngineCoreRequest

    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(5, 25)),
                             sampling_params=SamplingParams(max_tokens=8), arrival_time=0.0,
                             priority=0, eos_token_id=None)


def test_engines_added_removed_and_rolled_over_without_engines() -> None:
    from fake_engines import FakeEngineClient, fake_fleet

    from conveyor.engine.config import build_config
    from conveyor.engine.contracts import EngineCoreOutputs, SchedulerStats
    from conveyor.engine.dp.scale_policy import ScaleSettings
    from conveyor.engine.dp.scaling import Autoscaler

    cfg = build_config(data_parallel_size=2, router="round_robin", min_engines=1, max_engines=3,
                       **{"serve.autoscale_interval_s": 3600.0})
    dp = fake_fleet(cfg, [FakeEngineClient(), FakeEngineClient()])
    front = FakeFrontend()
    dp.start(front)
    try:
        assert dp.scaler.autoscaler is not None and dp.add_engine() == 2 and dp.router.n == 3
        for i in range(3):
            front.add(dp, _req(f"r{i}"))
        assert [len(c.added) for c in dp.clients] == [1, 1, 1]  # the router routes to the new engine
        old = dp.clients[2]  # reports idle once the drain has moved r2 off it
        threading.Timer(0.05, lambda: old.emit(EngineCoreOutputs(scheduler_stats=SchedulerStats()))).start()
        assert front.answering(dp, lambda: dp.remove_engine(2)) == (1, 1)  # r2 goes back through the frontend
        assert old.closed and [e["state"] for e in dp.engines()] == ["up", "up", "off"]
        assert sorted(r.request_id for c in dp.clients[:2] for r in c.added) == ["r0", "r1", "r2"]
        assert dp.add_engine() == 2 and dp.engine_count() == 3  # the emptied slot is reused
        # The autoscaler on its own clock: idle engines go down after the delay, to min_engines.
        scaler = Autoscaler(dp.scaler, ScaleSettings(min_engines=1, max_engines=3, downscale_delay_s=5.0), 1.0,
                            clock=lambda: now, start=False)
        for i in range(3):  # every engine reports idle (r0..r2 were never finished: drop them)
            dp.abort_requests([f"r{i}"])
        now = 0.0
        assert scaler.tick() == 0
        now = 5.0
        assert scaler.tick() == -1 and dp.engine_count() == 2
        # A rollout with one engine up: its successor starts first, then it drains.
        dp.scale_to(1)
        new_cfg = msgspec.structs.replace(cfg, scheduler=msgspec.structs.replace(cfg.scheduler, max_num_seqs=8))
        dp.rollout(new_cfg)
        up = [c for i, c in enumerate(dp.clients) if dp.states[i] == "up"]
        assert len(up) == 1 and up[0].config.scheduler.max_num_seqs == 8
        with pytest.raises(ValueError, match="the model changed"):
            dp.reload(msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, seed=3)))
        # Autoscaling knobs apply at once: a raised floor adds an engine, no rollout.
        got = dp.reload(msgspec.structs.replace(new_cfg, serve=msgspec.structs.replace(cfg.serve, min_engines=2)))
        assert got == {"changed": ["serve.min_engines"], "rolled_out": False, "moved_requests": 0}
        assert dp.engine_count() == 2 and dp.scaler.autoscaler.policy.settings.min_engines == 2
        dp.scaler.can_scale = False  # an engine pool's client (several ingress replicas)
        with pytest.raises(ValueError, match="engine pool"):
            dp.add_engine()
    finally:
        dp.shutdown()


# ---- two engines, streams in flight ---------------------------------------------------------

PROMPTS = ["The cat sits on the mat and", "Once upon a time there", "A list of colors:",
           "The dog runs to the ball"]
PARAMS = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=48, temperature=0.8, seed=7, ignore_eos=True)]


async def _run(llm, disrupt=None) -> list[tuple]:
    """(token ids, text, finish) of every stream; `disrupt` runs once all have started."""
    gens = [llm.generate(p, PARAMS[i % 2]) for i, p in enumerate(PROMPTS)]
    firsts = [await g.__anext__() for g in gens]
    if disrupt is not None:
        await disrupt()
    out = []
    for first, g in zip(firsts, gens):
        ids, text, finish = [], "", None
        for ro in [first] + [ro async for ro in g]:
            c = ro.outputs[0]
            ids, text, finish = ids + c.token_ids, text + c.text, c.finish_reason
        out.append((ids, text, finish))
    return out


def test_scale_down_and_reload_under_load_lose_no_request(tiny_llama) -> None:
    import httpx

    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    cfg = build_config(model=tiny_llama, max_model_len=256, data_parallel_size=2, router="round_robin",
                       min_engines=1, max_engines=2, **{"serve.autoscale_interval_s": 3600.0,
                                                        "serve.served_model_name": "tiny"})
    changed = msgspec.structs.replace(cfg, scheduler=msgspec.structs.replace(cfg.scheduler, max_num_seqs=8))

    async def scenario() -> None:
        llm = AsyncLLM(cfg)
        dp = llm.client
        dp.scaler.config_source = lambda: changed  # what the replica's config file says now
        srv = OpenAIServer(llm, cfg)
        app = build_api(srv, api_key="k")
        await srv.start()
        loop = asyncio.get_running_loop()
        try:
            ref = await _run(llm)
            assert [f for _, _, f in ref] == ["length"] * 4 and all(len(t) == 48 for t, _, _ in ref)

            replies = []

            async def reload() -> None:  # engine 0 drains at once, its successor starts, then engine 1's turn
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                             timeout=120) as c:
                    replies.append(await c.post("/admin/reload"))
                    replies.append(await c.post("/admin/reload", headers={"Authorization": "Bearer k"}))

            assert await _run(llm, reload) == ref
            assert replies[0].status_code == 401 and replies[1].status_code == 200, replies[1].text
            got = replies[1].json()
            assert got["changed"] == ["scheduler.max_num_seqs"] and got["moved_requests"] > 0, got
            assert [c.core.config.scheduler.max_num_seqs for c in dp.clients] == [8, 8]

            async def scale_down() -> None:
                assert await loop.run_in_executor(None, dp.scale_to, 1) > 0

            assert await _run(llm, scale_down) == ref
            assert sorted(e["state"] for e in dp.engines()) == ["off", "up"]
            slot = await loop.run_in_executor(None, dp.add_engine)  # scale 1 -> 2: the router routes to it
            before = dict(dp.router.decisions)
            assert await _run(llm) == ref
            assert sum(n - before.get(k, 0) for k, n in dp.router.decisions.items() if k[2] == slot) == 2
            assert not dp._live and dp.router.inflight.sum() == 0
        finally:
            await llm.shutdown()

    asyncio.run(scenario())
