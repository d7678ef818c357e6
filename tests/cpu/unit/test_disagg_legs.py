"""P/D on the data-parallel client (conveyor/engine/dp/disagg.py) over fake
engines: a hypothesis state machine with prefill legs that finish, fail,
come late or twice, aborts, and a prefill engine lost and back. Every
request reaches the frontend's stream exactly once as finished (or is
aborted), no leg's output ever reaches it, and nothing stays leased,
counted or live once every request has ended."""
from __future__ import annotations

import time

import pytest
from fake_engines import FakeEngineClient, fake_fleet
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conveyor.engine.config import ConfigError, build_config
from conveyor.engine.contracts import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from conveyor.engine.dp.disagg import LEG_SUFFIX
from conveyor.engine.sampling_params import SamplingParams

BS = 16
KW = dict(data_parallel_size=3, prefill_engines=1, offload_disk_path="/tmp/conveyor-pd-unused",
          offload_disk_gb=0.01)


def _req(rid: str, n: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[(i * 7 + len(rid)) % 500 + 1 for i in range(n)],
                             sampling_params=SamplingParams(max_tokens=4, temperature=0.0), arrival_time=0.0)


def _finish(engine: FakeEngineClient, rid: str, reason: FinishReason = FinishReason.LENGTH) -> None:
    assert engine.emit is not None
    engine.emit(EngineCoreOutputs(outputs=[EngineCoreOutput(rid, [7], reason)]))


class PDMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engines = [FakeEngineClient(block_size=BS) for _ in range(3)]
        self.dp = fake_fleet(build_config(**KW), self.engines)
        self.finished: dict[str, int] = {}
        self.dp.start(self._frontend)
        self.ids: list[str] = []
        self.ended: set[str] = set()  # finished or aborted

    def _frontend(self, outs: EngineCoreOutputs) -> None:
        assert outs.resume is None  # only a prefill engine is lost: it owns no request
        for o in outs.outputs:
            assert not o.request_id.endswith(LEG_SUFFIX), o
            if o.finished:
                self.finished[o.request_id] = self.finished.get(o.request_id, 0) + 1

    def _legs_on(self, e: int) -> list[str]:
        return [r.request_id for r in self.engines[e].added if r.request_id.endswith(LEG_SUFFIX)]

    @rule(n=st.integers(1, 80))
    def add(self, n: int) -> None:
        rid = f"r{len(self.ids)}"
        self.ids.append(rid)
        self.dp.add_request(_req(rid, n))

    @rule(pick=st.integers(0, 1 << 16), ok=st.booleans(), twice=st.booleans())
    def prefill_finishes(self, pick: int, ok: bool, twice: bool) -> None:
        legs = self._legs_on(0)
        if not legs:
            return
        lid = legs[pick % len(legs)]  # maybe one that already ended: a late or repeated report
        for _ in range(2 if twice else 1):
            _finish(self.engines[0], lid, FinishReason.LENGTH if ok else FinishReason.ERROR)

    @rule(pick=st.integers(0, 1 << 16))
    def decode_finishes(self, pick: int) -> None:
        live = [(rid, e) for rid, e in self.dp._live.items()]
        if not live:
            return
        rid, e = live[pick % len(live)]
        assert e in (1, 2), (rid, e)  # requests decode on decode engines only
        _finish(self.engines[e], rid)
        self.ended.add(rid)

    @rule(pick=st.integers(0, 1 << 16))
    def abort(self, pick: int) -> None:
        open_ = [r for r in self.ids if r not in self.ended]
        if open_:
            rid = open_[pick % len(open_)]
            self.dp.abort_requests([rid])
            self.ended.add(rid)

    @rule()
    def legs_run_late(self) -> None:
        with self.dp._lock:
            self.dp.pd.expire(time.monotonic() + 1e6)

    @precondition(lambda self: self.engines[0].hooks is not None)
    @rule(back=st.booleans())
    def prefill_engine_lost(self, back: bool) -> None:
        on_lost, on_back = self.engines[0].hooks
        on_lost("killed")
        if back:
            on_back()

    @invariant()
    def each_request_at_most_once_and_legs_bounded(self) -> None:
        assert all(n == 1 for n in self.finished.values()), self.finished
        assert len(self.dp.pd.legs) <= len(self.ids)
        for rid, e in self.dp._live.items():
            assert e != 0 and rid not in self.ended

    def teardown(self) -> None:
        # Everything still open ends: legs run late, decode finishes the rest.
        with self.dp._lock:
            self.dp.pd.expire(time.monotonic() + 1e6)
        for rid, e in list(self.dp._live.items()):
            _finish(self.engines[e], rid)
            self.ended.add(rid)
        assert len(self.dp.pd.legs) == 0 and not self.dp._live and not self.dp.pd._handed
        assert self.dp.router.inflight.sum() == 0 and abs(self.dp.router.load_tokens.sum()) < 1e-6
        for rid in self.ids:
            assert self.finished.get(rid, 0) == 1 or rid in self.ended, rid
        self.dp.shutdown()


PDMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPDStateMachine = PDMachine.TestCase


def test_short_prompts_and_no_prefill_engine_go_straight_to_decode() -> None:
    engines = [FakeEngineClient(block_size=BS) for _ in range(2)]
    dp = fake_fleet(build_config(**{**KW, "data_parallel_size": 2}), engines)
    dp.start(lambda outs: None)
    dp.add_request(_req("short", BS))  # no full block before the last token: nothing to hand over
    dp.add_request(_req("long", 3 * BS + 1))
    assert engines[1].added_ids == ["short"] and engines[0].added_ids == ["long" + LEG_SUFFIX]
    leg = engines[0].added[0]
    assert leg.sampling_params.max_tokens == 1 and leg.kv_lease_s > 0
    _finish(engines[0], "long" + LEG_SUFFIX)
    sent = engines[1].added[-1]
    assert sent.request_id == "long" and sent.kv_transfer is not None
    assert (sent.kv_transfer.source, sent.kv_transfer.num_blocks) == ("prefill", 3)
    assert engines[0].aborted == []  # leased until decode has computed on the KV
    engines[1].emit(EngineCoreOutputs(outputs=[EngineCoreOutput("long", [9])]))
    assert engines[0].aborted == ["long" + LEG_SUFFIX]  # the finished leg's abort: its lease ends
    assert [e["role"] for e in dp.engines()] == ["prefill", "decode"]
    dp.shutdown()


@pytest.mark.parametrize("over, key", [
    ({"prefill_engines": 2}, "parallel.prefill_engines"),
    ({"offload_disk_path": None, "offload_disk_gb": 0.0}, "cache.offload_disk_path"),
])
def test_pd_config_rules(over, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config(**{**KW, "data_parallel_size": 2, **over})


def test_an_engine_of_another_kv_layout_is_refused_before_anything_moves() -> None:
    from conveyor.engine.errors import KVLayoutMismatchError

    engines = [FakeEngineClient(block_size=BS) for _ in range(2)]
    dp = fake_fleet(build_config(**{**KW, "data_parallel_size": 2}), engines, spawn=lambda c: FakeEngineClient())
    dp.start(lambda outs: None)
    for over in ({"tensor_parallel_size": 2}, {"block_size": 32}, {"dtype": "bfloat16"}):
        with pytest.raises(KVLayoutMismatchError, match=next(iter(over))):
            dp.replace_engine(1, build_config(**{**KW, "data_parallel_size": 2, **over}))
        with pytest.raises(KVLayoutMismatchError):
            dp.add_engine(build_config(**{**KW, "data_parallel_size": 2, **over}))
    assert [e["state"] for e in dp.engines()] == ["up", "up"] and not engines[1].closed
    dp.shutdown()


def test_a_prefill_engine_dead_but_not_yet_noticed_does_not_break_decode_outputs() -> None:
    """Releasing a lease on a prefill engine whose actor just died raises in its
    client; that must not escape into the decode engine's output thread (its
    streams would hang): the output is delivered, the lease is simply gone."""
    from conveyor.engine.errors import EngineDeadError

    engines = [FakeEngineClient(block_size=BS) for _ in range(2)]
    dp = fake_fleet(build_config(**{**KW, "data_parallel_size": 2}), engines)
    got: list[EngineCoreOutputs] = []
    dp.start(got.append)
    dp.add_request(_req("long", 3 * BS + 1))
    _finish(engines[0], "long" + LEG_SUFFIX)

    def dead(ids: list[str]) -> None:
        raise EngineDeadError("engine actor died")

    engines[0].abort_requests = dead  # type: ignore[method-assign]
    engines[1].emit(EngineCoreOutputs(outputs=[EngineCoreOutput("long", [9])]))
    assert [o.request_id for outs in got for o in outs.outputs] == ["long"] and not dp.pd._handed
    dp.abort_requests(["long"])
    dp.shutdown()
