"""One request must never wedge a replica, slow everyone, or reach
the user as a 500. In process over the tests' FakeCore (fake_core.py: no Ray, no server):
values the engine link cannot encode, deep JSON, lone surrogates, a grammar
bomb, a huge prompt, the send thread and health."""
from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from fake_core import PROMPT, FakeCore, app_client, error_body, fake_llm, run_bounded

from conveyor.engine.contracts import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from conveyor.engine.errors import EngineDeadError, UnsendableRequestError
from conveyor.engine.sampling_params import SamplingFields, SamplingParams

LONE = "\udc00"


def _deep(depth: int, leaf: Any = 1) -> Any:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def _deep_schema(depth: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}}
    return s


async def _post(c, path: str, body: dict[str, Any]):
    """Raw JSON: lone surrogates go as `\\udc00` escapes (httpx's json= cannot)."""
    return await c.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A directory with only the tiny tokenizer: FakeCore needs no weights."""
    from tokenizer_utils import train_tiny_tokenizer

    path = str(tmp_path_factory.mktemp("probes"))
    train_tiny_tokenizer(path)
    return path


CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "description": "d",
                                         "parameters": {"type": "object", "properties": {}}}}
# (path, body, param): each passed validation on main, then failed deeper.
PROBES = [
    ("/v1/completions", {"prompt": PROMPT, "stop": [LONE]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "top_k": 2**64}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [2**70]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [512]}, "stop_token_ids"),  # = vocab
    ("/v1/completions", {"prompt": PROMPT, "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "a" + LONE}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", LONE]}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "x" + LONE}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}, "messages"),
    (CHAT, {"messages": MSGS, "tools": [{**TOOL, "function": {**TOOL["function"],
                                                              "description": LONE}}]}, "tools"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": _deep_schema(240)}}}, "response_format"),  # 480 levels
    (CHAT, {"messages": MSGS, "structured_outputs": {"json": {"enum": _deep(450)}}}, "structured_outputs"),
    (CHAT, {"messages": [*MSGS, {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}], "tools": [TOOL]}, "messages"),
    (CHAT, {"messages": MSGS, "user": LONE}, "user"),
    (CHAT, {"messages": MSGS, "max_tokens": 2**63}, "max_tokens"),
]


def test_values_the_engine_cannot_take_are_400s_naming_the_field(ckpt):
    async def run() -> None:
        core = FakeCore()
        async with app_client(fake_llm(core, model=ckpt)) as c:
            for path, body, param in PROBES:
                r = await _post(c, path, body)
                assert r.status_code == 400, (param, r.text)
                assert error_body(r)["param"] == param, (param, r.text)
            assert core.added == []  # nothing reached the engine
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
            assert r.status_code == 200, r.text

    run_bounded(run())


IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def test_an_image_for_a_text_only_model_is_a_400_saying_so(ckpt):
    """Image parts parse (OpenAI's shape) and are refused before any fetch;
    a malformed image part is a 400 too; the server goes on."""
    async def run() -> None:
        core = FakeCore()
        async with app_client(fake_llm(core, model=ckpt)) as c:
            r = await _post(c, CHAT, {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"}, IMAGE_PART]}]})
            assert r.status_code == 400 and error_body(r)["param"] == "messages", r.text
            assert "takes text only" in error_body(r)["message"], r.text
            r = await _post(c, CHAT, {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": 5}}]}]})
            assert r.status_code == 400, r.text
            assert core.added == []
            r = await _post(c, CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                      "max_tokens": 1})
            assert r.status_code == 200, r.text

    run_bounded(run())


def test_sampling_params_bound_every_integer_and_string():
    for kw, field in [({"top_k": 2**64}, "top_k"), ({"stop_token_ids": [2**70]}, "stop_token_ids"),
                      ({"max_tokens": 2**64}, "max_tokens"), ({"min_tokens": 2**64}, "min_tokens"),
                      ({"stop": [LONE]}, "stop")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            SamplingParams(**kw)
    SamplingParams(top_k=2**63 - 1)  # past the vocabulary: top-k is off (the sampler's rule)
    from conveyor.engine.structured_output.params import StructuredOutputsParams

    with pytest.raises(ValueError, match="nested deeper than"):
        StructuredOutputsParams(json=_deep_schema(480))
    with pytest.raises(ValueError, match="lone surrogate"):
        StructuredOutputsParams(regex="a" + LONE)


# ---- the send thread survives, and a dead thread fails health ------------------------------

class _Channel:
    """The InputSender's view of a Channel: msgspec encoding, sends recorded."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.event = threading.Event()
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, msg: Any) -> bytes:
        return self._enc.encode(msg)

    def try_send_payload(self, payload: bytes) -> bool:
        self.sent.append(payload)
        self.event.set()
        return True


def _request(rid: str, **sampling: Any) -> EngineCoreRequest:
    # trusted_copy: what a check the edge missed would carry (no validation).
    return EngineCoreRequest(request_id=rid, prompt_token_ids=PROMPT,
                             sampling_params=SamplingFields().trusted_copy(**sampling),
                             eos_token_id=None, arrival_time=0.0)


def test_an_unencodable_request_fails_alone_and_the_sender_goes_on():
    from conveyor.cluster.engine_actor.actor import CoreInput
    from conveyor.cluster.engine_actor.link import InputSender

    ch = _Channel()
    sender = InputSender(ch, lambda: None)
    try:
        for bad in ({"stop_token_ids": [2**70]}, {"top_k": 2**64}, {"stop": [LONE]}):
            with pytest.raises(UnsendableRequestError, match="could not be sent to the engine"):
                sender.put(CoreInput("add", _request("bad", **bad)))
        sender.put(CoreInput("add", _request("good")))
        assert ch.event.wait(30) and len(ch.sent) == 1 and sender.alive()
    finally:
        sender.close()


def test_a_dead_internal_thread_fails_health():
    from conveyor.cluster.engine_actor.client import RayCoreClient
    from conveyor.cluster.engine_actor.link import CoreActorSpec
    from conveyor.engine.config import build_config

    sender = SimpleNamespace(alive=lambda: True)
    link = SimpleNamespace(kv_info=None, sender=sender, status="ok", health_error=lambda _t: None)
    client = RayCoreClient(CoreActorSpec(build_config(max_model_len=256)), link)
    assert client.check_health() == "ok"
    sender.alive = lambda: False
    with pytest.raises(EngineDeadError, match="input-send thread died"):
        client.check_health()
    sender.alive = lambda: True
    client._reader = threading.Thread(target=lambda: None)
    client._reader.start()
    client._reader.join()
    with pytest.raises(EngineDeadError, match="output thread died"):
        client.check_health()


def test_an_unsendable_request_is_a_400_and_the_server_goes_on():
    class Refusing(FakeCore):
        def add_request(self, request: EngineCoreRequest) -> None:
            if request.sampling_params.top_k == 7:
                raise UnsendableRequestError("the request could not be sent to the engine: x")
            super().add_request(request)

    async def run() -> None:
        async with app_client(fake_llm(Refusing())) as c:
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "top_k": 7})
            assert r.status_code == 400 and "could not be sent" in error_body(r)["message"], r.text
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "top_k": 7, "stream": True})
            assert '"code":"invalid_value"' in r.text and r.text.endswith("data: [DONE]\n\n"), r.text
            r = await c.post("/v1/completions", json={"prompt": PROMPT})
            assert r.status_code == 200, r.text

    run_bounded(run())


# ---- grammar: a bomb is refused at the edge; a limit hit mid-generation is a 400 -------------

def test_a_grammar_bomb_is_refused_naming_the_limit(ckpt):
    async def run() -> None:
        core = FakeCore()
        async with app_client(fake_llm(core, model=ckpt)) as c:
            r = await c.post("/v1/completions", json={"prompt": PROMPT,
                                                      "structured_outputs": {"regex": "a{100000}"}})
            err = error_body(r)
            assert r.status_code == 400 and err["param"] == "structured_outputs", r.text
            assert "initial_lexer_fuel" in err["message"], r.text
            r = await c.post("/v1/completions", json={"prompt": PROMPT,
                                                      "structured_outputs": {"regex": "a{300}"}})
            assert r.status_code == 200, r.text
            assert core.added[-1].sampling_params.structured_outputs.regex == "a{300}"

    run_bounded(run())


def test_a_grammar_that_fails_mid_generation_is_a_400_naming_the_field(ckpt):
    why = "structured output grammar failed: Too many items (limit 50000)"

    class Failing(FakeCore):
        def add_request(self, request: EngineCoreRequest) -> None:
            self.on_outputs(EngineCoreOutputs([EngineCoreOutput(
                request.request_id, [], FinishReason.ERROR, error=why)]))

    async def run() -> None:
        async with app_client(fake_llm(Failing(), model=ckpt)) as c:
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "structured_outputs": {
                "choice": ["a", "b"]}})
            assert r.status_code == 400 and error_body(r)["code"] == "grammar_error", r.text
            assert error_body(r)["param"] == "structured_outputs" and "Too many items" in r.text

    run_bounded(run())


def test_a_matcher_error_ends_the_request_with_its_reason():
    from sched_utils import make_request

    from conveyor.engine.core.stopping import grammar_done as _grammar_done

    req = make_request("r", [1, 2])
    grammar = SimpleNamespace(accept_tokens=lambda _t: False, error=lambda: "Too many items")
    assert _grammar_done(req, grammar, 5)
    assert req.stop_reason == "structured output grammar failed: Too many items"


# ---- a large prompt: bounded before tokenizing, tokenized off the event loop ----------------

def test_a_prompt_past_any_context_is_refused_without_tokenizing(ckpt, monkeypatch):
    from conveyor.engine.frontend.tokenizer import Tokenizer

    def never(*_a: Any, **_k: Any) -> list[int]:
        raise AssertionError("tokenized a prompt that can never fit")

    monkeypatch.setattr(Tokenizer, "encode", never)
    monkeypatch.setattr(Tokenizer, "encode_nogil", never)

    async def run() -> None:
        async with app_client(fake_llm(FakeCore(), model=ckpt)) as c:
            r = await c.post("/v1/completions", json={"prompt": "ab " * 200_000})
            assert r.status_code == 400 and error_body(r)["code"] == "context_length_exceeded", r.text
            r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "ab " * 200_000}]})
            assert r.status_code == 400 and error_body(r)["code"] == "context_length_exceeded", r.text

    run_bounded(run())


def test_a_large_prompt_is_tokenized_off_the_event_loop(ckpt, monkeypatch):
    """The big prompt's tokenization waits until a small request has been
    answered: on the event loop it would deadlock (the wait_for fails)."""
    import conveyor.cluster.openai.request_prep as S
    from conveyor.engine.frontend.tokenizer import Tokenizer

    monkeypatch.setattr(S, "INLINE_CHARS", 100)
    entered, small_done = threading.Event(), threading.Event()
    real = Tokenizer.encode_nogil

    def gated(self: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
        entered.set()
        assert small_done.wait(30), "the event loop was blocked"
        return real(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode_nogil", gated)

    async def run() -> None:
        async with app_client(fake_llm(FakeCore(), model=ckpt)) as c:
            big = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "the cat " * 20,
                                                                         "max_tokens": 1}))
            assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200, r.text
            small_done.set()
            r = await big
            assert r.status_code == 200, r.text

    run_bounded(run())


def test_offline_prompts_with_lone_surrogates_are_value_errors(ckpt):
    llm = fake_llm(FakeCore(), model=ckpt)
    with pytest.raises(ValueError, match="^prompt string holds a lone surrogate|^prompt holds a lone"):
        llm.frontend.prepare("a" + LONE, SamplingParams(), "r")
