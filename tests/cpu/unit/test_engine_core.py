"""EngineCore: step() and step_with_batch_queue() against a scripted executor."""
from __future__ import annotations

import pytest
from sched_utils import EOS, FakeExecutor

from conveyor.engine.config import build_config
from conveyor.engine.contracts import EngineCoreRequest
from conveyor.engine.core.engine_core import EngineCore
from conveyor.engine.sampling_params import SamplingParams


def _core(queue_size: int, delay: float = 0.0, **kw) -> EngineCore:
    cfg = build_config(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8, **kw)
    return EngineCore(cfg, FakeExecutor(num_blocks=200, queue_size=queue_size, delay_s=delay))


def _requests(n: int = 6) -> list[EngineCoreRequest]:
    return [EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=[i + 1] * (10 + 13 * i),
                              sampling_params=SamplingParams(max_tokens=5 + i), eos_token_id=EOS)
            for i in range(n)]


def _run(core: EngineCore, abort_at: dict[int, str] | None = None,
         requests: list[EngineCoreRequest] | None = None) -> dict[str, list[int]]:
    for r in requests or _requests():
        core.add_request(r)
    tokens: dict[str, list[int]] = {}
    steps = 0
    while core.has_work():
        if abort_at and steps in abort_at:
            core.abort_requests([abort_at[steps]])
        outs, _ = core.step_fn()
        steps += 1
        for o in (outs.outputs if outs else []):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert steps < 500
    return tokens


def test_batch_queue_matches_step():
    ref = _run(_core(1))
    core = _core(2, delay=0.002)
    assert core.step_fn == core.step_with_batch_queue
    got = _run(core)
    assert got == ref
    assert sorted(len(v) for v in got.values()) == [5, 6, 7, 8, 9, 10]
    core.shutdown()


def test_batch_queue_never_double_schedules():
    core = _core(2, delay=0.002)
    sched = core.scheduler
    orig = sched.schedule
    in_flight: list[int] = []  # batches already in flight at each schedule()

    def spy():
        so = orig()
        # A request whose sampled token is pending has num_computed == num_tokens.
        for rid in so.num_scheduled_tokens:
            r = sched.requests[rid]
            assert r.num_computed_tokens <= r.num_tokens
        in_flight.append(len(core.batch_queue))
        return so

    sched.schedule = spy
    _run(core)
    assert max(in_flight) == 1  # a second batch was scheduled while one was in flight
    core.shutdown()


def test_abort_mid_flight_with_batch_queue():
    core = _core(2, delay=0.002)
    got = _run(core, abort_at={3: "r5"})
    assert len(got.get("r5", [])) < 10
    assert "r5" not in core.scheduler.requests
    assert not core.scheduler.running and not core.scheduler.waiting
    assert core.scheduler.kv_cache_manager.get_num_free_blocks() == 199
    core.shutdown()


def test_add_request_validation():
    # An empty prompt and the context length are checked once, at the edge
    # (conveyor/engine/frontend/prepare.py, test_malformed_requests_fail_alone); the core checks
    # what it alone knows: the request fits its KV pool, and its id is new.
    core = _core(1)
    with pytest.raises(ValueError, match="KV blocks"):
        core.add_request(EngineCoreRequest(request_id="y", prompt_token_ids=[1] * (
            core.kv_info.num_blocks * core.kv_info.block_size), sampling_params=SamplingParams()))
    assert not core.scheduler.has_requests()
    core.add_request(_requests(1)[0])
    with pytest.raises(ValueError, match="already"):
        core.add_request(_requests(1)[0])
    core.shutdown()


@pytest.mark.parametrize("blocks", [200, 12])  # 12: decode must preempt
def test_async_scheduling_matches_step(blocks):
    """Async scheduling plans step N+1 while N runs (placeholders for N's
    tokens) and gives the tokens of the synchronous loop, preemption included."""
    def core(queue_size: int, **kw) -> EngineCore:
        cfg = build_config(max_model_len=min(512, (blocks - 1) * 16), max_num_batched_tokens=64,
                           max_num_seqs=8, **kw)
        return EngineCore(cfg, FakeExecutor(num_blocks=blocks, queue_size=queue_size, delay_s=0.002))

    # Six 20-token prompts growing to 60 tokens: 11 usable blocks hold five
    # prompts but not their growth.
    reqs = [EngineCoreRequest(request_id=f"p{i}", prompt_token_ids=[i + 1] * 20, eos_token_id=EOS,
                              sampling_params=SamplingParams(max_tokens=40 - i)) for i in range(6)]
    sync = core(1, async_scheduling="off")
    ref = _run(sync, requests=reqs)
    sync.shutdown()
    c = core(1, async_scheduling="on")
    assert c.step_fn == c.step_async and c.scheduler.async_scheduling
    sched, orig, in_flight = c.scheduler, c.scheduler.schedule, []

    def spy():
        in_flight.append(len(c.batch_queue))
        return orig()

    sched.schedule = spy
    assert _run(c, requests=reqs) == ref
    assert max(in_flight) == 1 and c.executor.max_in_flight == 1
    assert (sched.num_preemptions > 0) == (blocks == 12)
    assert not sched.requests and sched.kv_cache_manager.get_num_free_blocks() == blocks - 1
    c.shutdown()


def test_async_scheduling_auto_and_bounds():
    assert not _core(1).async_scheduling  # auto: off where the forward is on the CPU
    from conveyor.engine.config import ConfigError
    with pytest.raises(ConfigError, match="scheduler.async_scheduling"):
        build_config(async_scheduling="sometimes")
    with pytest.raises(ConfigError, match="scheduler.async_scheduling"):
        build_config(async_scheduling=True, pipeline_parallel_size=2)
    assert build_config(async_scheduling=False).scheduler.async_scheduling is False
    # The CLI flags reach the same keys (`--async-scheduling on`, `--enforce-eager true`).
    from conveyor.cluster.cli.options import ENGINE_OVERRIDES
    keys = {o.flag: o.key for o in ENGINE_OVERRIDES}
    assert keys["--async-scheduling"] == "scheduler.async_scheduling"
    assert keys["--enforce-eager"] == "model.enforce_eager"
    assert build_config(**{"scheduler.async_scheduling": "on"}).scheduler.async_scheduling == "on"


def test_starting_a_core_thread_lowers_the_switch_interval_never_raises_it(monkeypatch) -> None:
    """CoreThread lowers the process's GIL switch interval to its bound (the
    step thread waits less for the GIL behind a server's Python threads), and
    leaves a lower one alone; a failed build still raises in the caller."""
    import sys

    from conveyor.engine.core import core_thread

    def boom() -> None:
        raise RuntimeError("no cores for you")

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        with pytest.raises(RuntimeError, match="no cores for you"):
            core_thread.CoreThread(build_config(max_model_len=512), "t", prepare=boom)
        assert sys.getswitchinterval() == pytest.approx(core_thread.STEP_SWITCH_INTERVAL_S)
        sys.setswitchinterval(0.0001)
        with pytest.raises(RuntimeError):
            core_thread.CoreThread(build_config(max_model_len=512), "t", prepare=boom)
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        sys.setswitchinterval(before)
