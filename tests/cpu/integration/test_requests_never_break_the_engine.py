"""Requests that must never break, hang or mislead the engine, and input
validated once at the edge.

Most tests drive AsyncLLM and the OpenAI app in process over a FakeCore: a
CoreClient that records what it is sent and emits only the outputs a test
injects, so every interleaving is exact. Two use the real engine on a tiny
checkpoint (no Ray)."""
from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest
from fake_core import PROMPT, FakeCore, app_client, engine_config, error_body, fake_llm, run_bounded
from sched_utils import FakeExecutor, append_token, make_request

from conveyor.engine.config import ConfigError, build_config
from conveyor.engine.contracts import (
    EngineCoreRequest,
    FinishReason,
    NewRequestData,
    RequestStatus,
)
from conveyor.engine.core.stopping import check_stop
from conveyor.engine.errors import EngineDeadError
from conveyor.engine.sampling_params import SamplingParams


def _events(text: str) -> list[str]:
    return [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


# ---- max_tokens=None and min_tokens ------------------------------------------------------

def test_min_tokens_must_fit_the_context(ckpt):
    from conveyor.engine import LLM

    llm = LLM(model=ckpt, max_model_len=64)  # small: the fills below stay fast
    try:
        with pytest.raises(ValueError, match=r"^min_tokens \(5000\)"):
            llm.generate([PROMPT], SamplingParams(max_tokens=None, min_tokens=5000), use_tqdm=False)
        out = llm.generate([PROMPT], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 64 - len(PROMPT) and out.finish_reason == "length"
        out = llm.generate([PROMPT], SamplingParams(max_tokens=None, min_tokens=20), use_tqdm=False)[0]
        assert 20 <= len(out.outputs[0].token_ids) <= 64 - len(PROMPT)
    finally:
        llm.shutdown()


def test_length_cap_holds_under_min_tokens():
    """Whatever slips past validation, a request never outgrows max_model_len."""
    req = make_request("r", [1] * 60, max_tokens=None, min_tokens=5000, max_model_len=64)
    for _ in range(3):
        append_token(req, 7)
        assert not check_stop(req, 64)
    append_token(req, 7)
    assert check_stop(req, 64) and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_http_min_tokens_without_max_tokens(ckpt):
    async def run() -> None:
        core = FakeCore()
        llm = fake_llm(core, model=ckpt)
        async with app_client(llm) as c:
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "min_tokens": 3})
            assert r.status_code == 200, r.text
            sp = core.added[-1].sampling_params
            assert sp.max_tokens is None and sp.min_tokens == 3
            # An explicit null is the field left out (OpenAI's nullable fields):
            # completions' own default of 16 applies.
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "min_tokens": 3,
                                                      "max_tokens": None})
            assert r.status_code == 200, r.text
            sp = core.added[-1].sampling_params
            assert sp.max_tokens == 16 and sp.min_tokens == 3
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "min_tokens": 300,
                                                      "max_tokens": None})
            assert r.status_code == 400 and error_body(r)["param"] == "min_tokens", r.text

    run_bounded(run())


# ---- a KV pool too small for one request ----------------------------------------------------

def test_engine_refuses_a_pool_that_cannot_hold_max_model_len(ckpt):
    from conveyor.engine import LLM

    with pytest.raises(ConfigError, match=r"needs 64 blocks: raise cache\.num_gpu_blocks to at least "
                                          r"65 .*max_model_len to 112 or less"):
        LLM(model=ckpt, num_gpu_blocks=8, block_size=16)
    llm = LLM(model=ckpt, num_gpu_blocks=8, block_size=16, max_model_len=112)
    try:
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([[5] * 600], SamplingParams(max_tokens=4), use_tqdm=False)
        # The largest request that fits runs alone in the whole pool.
        out = llm.generate([[5] * 100], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 12
    finally:
        llm.shutdown()


def test_core_refuses_measured_pool_and_names_the_memory_knob():
    from conveyor.engine.core.engine_core import EngineCore

    ex = FakeExecutor(num_blocks=8, block_size=16)
    with pytest.raises(ConfigError, match=r"7 usable blocks of 16 tokens.*needs 16 blocks.*"
                                          r"cache\.cpu_kv_cache_bytes"):
        EngineCore(engine_config(), ex)
    assert ex.pool._shutdown  # the executor it started is shut down, not leaked


# ---- bounded requests, admission by engine requests, priority, websockets -----------------

def test_stop_lists_are_bounded():
    with pytest.raises(ValueError, match="^stop must hold at most 16"):
        SamplingParams(stop=[f"s{i}" for i in range(17)])
    with pytest.raises(ValueError, match="^stop strings must be at most 256"):
        SamplingParams(stop=["x" * 257])
    with pytest.raises(ValueError, match="^stop_token_ids must hold at most 256"):
        SamplingParams(stop_token_ids=list(range(257)))
    SamplingParams(stop=["x" * 256] * 16, stop_token_ids=list(range(256)))

    async def run() -> None:
        async with app_client(fake_llm(FakeCore())) as c:
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "stop": ["a"] * 5000})
            assert r.status_code == 400 and error_body(r)["param"] == "stop", r.text
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "stop_token_ids": [1] * 300})
            assert r.status_code == 400 and error_body(r)["param"] == "stop_token_ids", r.text

    run_bounded(run())


def test_admission_counts_engine_requests():
    async def run() -> None:
        core = FakeCore(finish=False)
        llm = fake_llm(core)
        from conveyor.cluster.openai.app import build_api
        from conveyor.cluster.openai.server import OpenAIServer

        srv = OpenAIServer(llm, llm.config, max_admitted=6)
        transport = httpx.ASGITransport(app=build_api(srv, api_key=None))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": [PROMPT] * 50, "max_tokens": 1})
            assert r.status_code == 400 and error_body(r)["code"] == "too_many_sequences", r.text
            r = await c.post("/v1/completions", json={"prompt": [PROMPT] * 3, "n": 3, "max_tokens": 1})
            assert r.status_code == 400 and error_body(r)["code"] == "too_many_sequences", r.text
            assert core.added == []  # nothing reached the engine
            # 2 prompts x n=2 = 4 slots in flight; another 4 do not fit in 6.
            first = asyncio.create_task(c.post("/v1/completions", json={
                "prompt": [PROMPT] * 2, "n": 2, "max_tokens": 1}))
            while len(core.added) < 4:
                core.added_event.clear()
                await core.added_event.wait()
            assert srv.admitted == 4
            r = await c.post("/v1/completions", json={"prompt": [PROMPT] * 2, "n": 2, "max_tokens": 1})
            assert r.status_code == 429 and error_body(r)["code"] == "server_at_capacity", r.text
            for req in core.added:
                core.emit(req.request_id, [11], FinishReason.LENGTH)
            r = await first
            assert r.status_code == 200 and len(r.json()["choices"]) == 4
            assert srv.admitted == 0

    run_bounded(run())


def test_client_priority_needs_the_config_switch():
    async def run() -> None:
        core = FakeCore()
        async with app_client(fake_llm(core)) as c:
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "priority": -5})
            assert r.status_code == 400 and error_body(r)["param"] == "priority", r.text
            assert (await c.post("/v1/completions", json={"prompt": PROMPT, "priority": 0})).status_code == 200
        async with app_client(fake_llm(core, **{"serve.allow_client_priority": True})) as c:
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "priority": -5})
            assert r.status_code == 200, r.text
            assert core.added[-1].priority == -5

    run_bounded(run())


async def _ws_connect(app: Any, headers: list[tuple[bytes, bytes]] | None = None) -> list[dict]:
    sent: list[dict] = []
    inbox = [{"type": "websocket.connect"}]

    async def receive() -> dict:
        return inbox.pop(0) if inbox else {"type": "websocket.disconnect", "code": 1000}

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = {"type": "websocket", "path": "/v1/completions", "root_path": "", "query_string": b"",
             "headers": headers or [], "scheme": "ws", "server": ("t", 80), "client": ("c", 1),
             "subprotocols": [], "asgi": {"version": "3.0"}}
    await app(scope, receive, send)
    return sent


def test_websocket_scopes_are_refused_unless_a_route_declares_them():
    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.middleware import AuthMiddleware
    from conveyor.cluster.openai.server import OpenAIServer

    policy_violation = 1008  # the websocket close code for "not allowed"

    reached: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["type"])

    async def run() -> None:
        llm = fake_llm(FakeCore())
        app = build_api(OpenAIServer(llm, llm.config), api_key="k")
        assert await _ws_connect(app) == [{"type": "websocket.close", "code": policy_violation}]
        mw = AuthMiddleware(inner, api_key="k", public_paths=frozenset())
        await _ws_connect(mw, [(b"authorization", b"Bearer k")])
        assert reached == []  # no route declared websockets: never past the middleware
        mw = AuthMiddleware(inner, api_key="k", public_paths=frozenset(),
                            scope_types=frozenset({"websocket"}))
        assert await _ws_connect(mw) == [{"type": "websocket.close", "code": policy_violation}]
        await _ws_connect(mw, [(b"authorization", b"Bearer k")])
        assert reached == ["websocket"]  # declared and authenticated

    run_bounded(run())


# ---- a reused request id never gets the earlier request's tokens -----------------------------

def test_reused_request_id_never_receives_earlier_tokens():
    async def run() -> None:
        core = FakeCore(finish=False)
        llm = fake_llm(core)
        sp = SamplingParams(max_tokens=8, ignore_eos=True)
        first = llm.generate(PROMPT, sp, request_id="X")
        step = asyncio.create_task(first.__anext__())
        await core.added_event.wait()
        old_id = core.added[0].request_id
        core.emit(old_id, [7])
        assert (await step).outputs[0].token_ids == [7]
        await first.aclose()  # the client went away: abort on its way to the core
        assert core.aborted == [old_id]
        core.added_event.clear()
        retry = llm.generate(PROMPT, sp, request_id="X")
        step = asyncio.create_task(retry.__anext__())
        await core.added_event.wait()
        new_id = core.added[1].request_id
        assert new_id != old_id and new_id.startswith("X-0-")
        core.emit(old_id, [9, 9])  # a step of the earlier request was still in flight
        core.emit(new_id, [5])
        assert (await step).outputs[0].token_ids == [5]
        await retry.aclose()

    run_bounded(run())


def test_a_request_id_in_use_is_refused_by_the_one_check_and_free_after_its_stream():
    async def run() -> None:
        core = FakeCore(finish=False)
        llm = fake_llm(core)
        sp = SamplingParams(max_tokens=8)
        first = llm.generate(PROMPT, sp, request_id="a")
        step = asyncio.create_task(first.__anext__())
        await core.added_event.wait()
        with pytest.raises(ValueError, match="'a' is already in use"):
            await llm.generate(PROMPT, sp, request_id="a").__anext__()
        with pytest.raises(ValueError, match="'a' is already in use"):
            llm.reserve_ids(["b", "a"])
        llm.reserve_ids(["b"])  # the refused call took nothing
        with pytest.raises(ValueError, match="'b' is already in use"):  # reserved, no stream yet
            llm.reserve_ids(["b"])
        core.emit(core.added[0].request_id, [11], FinishReason.LENGTH)
        assert (await step).finished
        llm.reserve_ids(["a"])  # its stream ended: free again
        llm.release_ids(["a", "b"])
        assert len(core.added) == 1  # nothing refused reached the engine

    run_bounded(run())


# ---- one EngineDeadError: 503, and batch lines stay undone -----------------------------------

def test_one_engine_dead_error_class():
    import conveyor.engine.frontend.async_client
    import conveyor.executors.base

    assert conveyor.executors.base.EngineDeadError is conveyor.engine.frontend.async_client.EngineDeadError is EngineDeadError


def test_one_dead_flag_shared_by_the_frontend_its_client_and_an_in_process_loop():
    """The client detects the death (here its in-process core loop dies) and
    AsyncLLM reads the same record before any engine_error message arrives."""
    from conveyor.engine.core.busy_loop import EngineBusyLoop
    from conveyor.engine.frontend.async_client import AsyncLLM

    core = FakeCore()
    llm = AsyncLLM(engine_config(), core)
    assert llm.dead is core.dead and llm.dead_error is None
    loop = EngineBusyLoop(SimpleNamespace(has_work=lambda: True, step_fn=lambda: 1 / 0),
                          lambda outs: None, core.dead)
    loop.run()  # the step raises: the loop records why and ends
    assert llm.dead_error == loop.error == "ZeroDivisionError: division by zero"
    with pytest.raises(EngineDeadError, match="ZeroDivisionError"):
        llm.check_health()
    with pytest.raises(EngineDeadError, match="ZeroDivisionError"):
        llm.prepare(PROMPT, SamplingParams(max_tokens=2))


def test_dead_engine_actor_is_503_not_500():
    async def run() -> None:
        async with app_client(fake_llm(FakeCore(fail_after=0))) as c:
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 503 and error_body(r)["code"] == "engine_unavailable", r.text
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True})
            events = _events(r.text)
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"

    run_bounded(run())


def test_batch_line_failed_by_a_dead_engine_is_not_done(tmp_path):
    from conveyor.cluster.batch.engines import LineRunner, LocalEngine
    from conveyor.cluster.batch.job import BatchLine, OutputLog, Progress, Summary, drive
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.errors import EngineDeadError

    async def run() -> None:
        llm = fake_llm(FakeCore(fail_after=0))
        runner = LineRunner(llm, OpenAIServer(llm, llm.config))
        line = BatchLine(1, "a", {"custom_id": "a", "url": "/v1/completions",
                                  "body": {"prompt": PROMPT, "max_tokens": 2}})
        out = OutputLog(str(tmp_path / "out.jsonl"))
        assert out.open() == set()
        try:
            with pytest.raises(EngineDeadError):
                await drive([LocalEngine(runner, 1)], [line], out, Progress(Summary(1), False))
        finally:
            out.close()
        assert OutputLog.done_ids(str(tmp_path / "out.jsonl")) == set()  # a rerun runs it

    run_bounded(run())


# ---- the event loop never blocks; a failed add cleans up -----------------------------------

class GatedChannel:
    """An input channel whose peer takes nothing until `open` is set."""

    def __init__(self, expect: int) -> None:
        self.open, self.done = threading.Event(), threading.Event()
        self.expect, self.sent, self.threads = expect, [], set()

    def encode(self, msg: Any) -> bytes:
        return msgspec.msgpack.encode(msg)

    def try_send_payload(self, payload: bytes) -> bool:
        self.threads.add(threading.get_ident())
        if not self.open.is_set():
            return False
        from conveyor.cluster.engine_actor.actor import CoreInput

        self.sent.append(msgspec.msgpack.decode(payload, type=CoreInput))
        if len(self.sent) == self.expect:
            self.done.set()
        return True

    def close(self) -> None:
        return None


def test_ray_core_client_send_never_blocks_the_caller():
    from conveyor.cluster.engine_actor.client import RayCoreClient
    from conveyor.cluster.engine_actor.link import CoreActorSpec, CoreLink
    from conveyor.engine.contracts import KVCacheInfo

    ch = GatedChannel(expect=2)
    # No actor: only the input path.
    client = RayCoreClient(CoreActorSpec(build_config()), CoreLink(None, None, ch, ch, KVCacheInfo(8, 16)))
    try:
        req = EngineCoreRequest(request_id="r-0", prompt_token_ids=PROMPT,
                                sampling_params=SamplingParams(max_tokens=2).trusted_copy())
        client.add_request(req)  # returns although the actor takes nothing yet
        client.abort_requests(["r-0"])
        assert ch.sent == []
        ch.open.set()
        assert ch.done.wait(30)
        assert [m.kind for m in ch.sent] == ["add", "abort"] and ch.sent[0].request == req
        assert threading.get_ident() not in ch.threads  # sent from the sender thread
        client.dead.set("engine actor failed: ActorDiedError")
        with pytest.raises(EngineDeadError, match="ActorDiedError"):
            client.add_request(req)
    finally:
        client.link.sender.close()


def test_failed_add_aborts_its_siblings_and_drops_the_stream():
    async def run() -> None:
        core = FakeCore(finish=False, fail_after=1)
        llm = fake_llm(core)
        gen = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=4), request_id="Y")
        with pytest.raises(EngineDeadError):
            await gen.__anext__()
        assert [r.request_id for r in core.added] == core.aborted and len(core.aborted) == 1
        assert llm.streams == {} and llm._child_to_stream == {}
        core.fail_after = None  # the id is free again
        gen = llm.generate(PROMPT, SamplingParams(max_tokens=4), request_id="Y")
        step = asyncio.create_task(gen.__anext__())
        core.added_event.clear()
        await core.added_event.wait()
        core.emit(core.added[-1].request_id, [3], FinishReason.LENGTH)
        assert (await step).finished

    run_bounded(run())


# ---- validate once at the edge -----------------------------------------------------------------

def _count_validations(monkeypatch) -> list[int]:
    calls = [0]
    orig = SamplingParams.validate

    def counting(self, *a: Any, **kw: Any) -> None:
        calls[0] += 1
        orig(self, *a, **kw)

    monkeypatch.setattr(SamplingParams, "validate", counting)
    return calls


def test_decoding_never_revalidates(monkeypatch):
    calls = _count_validations(monkeypatch)
    sp = SamplingParams(temperature=0.5, stop=["x"], n=2)
    assert calls[0] == 1
    data = msgspec.msgpack.encode(NewRequestData("r", PROMPT, sp, [1], 0))
    dec = msgspec.msgpack.Decoder(NewRequestData)
    for _ in range(100):  # every step's SchedulerOutput in every worker
        assert dec.decode(data).sampling_params == sp.trusted_copy()
    assert sp.trusted_copy(n=1).n == 1  # what the frontend makes of n children
    assert calls[0] == 1
    with pytest.raises(ValueError, match="temperature"):  # construction still checks
        SamplingParams(temperature=float("nan"))


def test_one_validation_per_http_request(monkeypatch):
    calls = _count_validations(monkeypatch)

    async def run() -> None:
        async with app_client(fake_llm(FakeCore())) as c:
            r = await c.post("/v1/completions", json={"prompt": [PROMPT, PROMPT], "n": 2,
                                                      "max_tokens": 2, "seed": 3})
            assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text

    run_bounded(run())
    assert calls[0] == 1
