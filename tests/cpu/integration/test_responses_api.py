"""/v1/responses (OpenAI's Responses API) in process, through the official
client and the openai-agents SDK: create (JSON and the typed event stream),
instructions, input items, function tools and their outputs, text.format
schemas, store + previous_response_id (tool calls survive), retrieve, delete;
plus the bounded, expiring store and /tokenize, /detokenize, /v1/models/{id}.
The cluster store (a Ray actor over sqlite) is tested in test_serve.py."""
from __future__ import annotations

import asyncio
import json
from typing import Annotated

import jsonschema
import pytest
from asgi_utils import in_process_api, openai_client, run_on
from llm_utils import make_checkpoint
from pydantic import Field

ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD}]
ANSWER = {"type": "object", "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["sum"], "additionalProperties": False}
Small = Annotated[int, Field(ge=0, le=99)]  # a tool's bounded argument: a random model writes digits forever
FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("responses") / "llama"),
                           max_position_embeddings=2048)


@pytest.fixture(scope="module")
def api(ckpt):
    """(event loop, FastAPI app, AsyncLLM) on one loop for the whole module."""
    yield from in_process_api(ckpt, max_model_len=2048)


def _run(api, coro_fn):
    loop, app, _ = api
    return run_on(loop, app, coro_fn)


_openai = openai_client


def test_create_retrieve_delete_through_the_client(api):
    """A response is the chat completion of the same messages (instructions
    are the system message): greedy on fixed weights, this one is cut at
    max_output_tokens. Retrieve returns it as created; delete answers the
    deletion object, then both calls are 404."""
    async def go(c):
        client = _openai(c)
        r = await client.responses.create(model="tiny", instructions="Be brief.", input="Hello there",
                                          max_output_tokens=8, temperature=0.0)
        chat = await c.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 8, "temperature": 0.0,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]})
        got = await client.responses.retrieve(r.id)
        gone = await client.responses.with_raw_response.delete(r.id)
        missing = await c.get(f"/v1/responses/{r.id}")
        again = await c.delete(f"/v1/responses/{r.id}")
        return r, chat.json(), got, gone, missing, again
    r, chat, got, gone, missing, again = _run(api, go)
    assert r.object == "response" and r.id.startswith("resp_")
    assert (chat["choices"][0]["finish_reason"], chat["usage"]["completion_tokens"]) == ("length", 8)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat["usage"]["prompt_tokens"], 8)
    assert r.output_text == chat["choices"][0]["message"]["content"] != ""
    assert [(o.type, o.role, o.status) for o in r.output] == [("message", "assistant", "incomplete")]
    assert r.instructions == "Be brief." and r.max_output_tokens == 8
    assert got.model_dump() == r.model_dump()
    assert (gone.status_code, gone.http_response.json()) == (200, {"id": r.id, "object": "response",
                                                                   "deleted": True})
    for resp in (missing, again):
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "response_not_found"


def test_stream_event_sequence_matches_the_json_response(api):
    async def go(c):
        client = _openai(c)
        kw = dict(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                  max_output_tokens=12, temperature=0.0)
        events = [e async for e in await client.responses.create(stream=True, **kw)]
        plain = await client.responses.create(**kw)
        return events, plain
    events, plain = _run(api, go)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    final = "response.incomplete" if plain.usage.output_tokens == 12 else "response.completed"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", final]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_call_then_output_with_previous_response_id(api, stream):
    """A forced call; its output item goes back with previous_response_id (the
    stored call is prepended, or the tool turn would match no call: 400)."""
    async def go(c):
        client = _openai(c)
        kw = dict(model="tiny", input="What is 2 plus 3?", tools=TOOLS, max_output_tokens=200,
                  tool_choice={"type": "function", "name": "add"}, temperature=1.0, extra_body={"seed": 3})
        if stream:
            events = [e async for e in await client.responses.create(stream=True, **kw)]
            first = events[-1].response
        else:
            events, first = [], await client.responses.create(**kw)
        call = first.output[-1]
        follow = await client.responses.create(
            model="tiny", previous_response_id=first.id, tools=TOOLS, text=FORMAT, max_output_tokens=40,
            tool_choice="none", temperature=0.0,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
        return events, first, follow
    events, first, follow = _run(api, go)
    call = first.output[-1]
    assert first.status == "completed" and call.type == "function_call" and call.name == "add"
    jsonschema.validate(json.loads(call.arguments), {**ADD, "additionalProperties": False})
    if stream:
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done[-1].arguments == call.arguments and kinds[-1] == "response.completed"
    assert follow.previous_response_id == first.id and follow.status == "completed"
    jsonschema.validate(json.loads(follow.output_text), ANSWER)
    assert follow.usage.input_tokens > first.usage.input_tokens


def test_input_items_and_errors(api):
    history = [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "2+3?"},
               {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "5"}]

    async def go(c):
        ok = await c.post("/v1/responses", json={"input": history, "tools": TOOLS, "max_output_tokens": 2,
                                                 "store": False})
        unstored = await c.get(f"/v1/responses/{ok.json()['id']}")
        bad = [await c.post("/v1/responses", json=b) for b in (
            {"input": "x", "previous_response_id": "resp_nope"},
            {"input": [{"type": "input_image", "image_url": "x"}]},
            {"input": "x", "tools": [{"type": "web_search"}]},
            {"input": "x", "max_output_tokens": -1},
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}},
            {"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]})]
        return ok, unstored, bad
    ok, unstored, bad = _run(api, go)
    assert ok.status_code == 200, ok.text
    assert unstored.status_code == 404
    params = [r.json()["error"]["param"] for r in bad]
    assert [r.status_code for r in bad] == [404, 400, 400, 400, 400, 400]
    assert params == ["previous_response_id", "input", "tools", "max_output_tokens", "text", "input"]


def test_openai_agents_runs_a_tool_then_its_output_type(api):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # its traces would go to api.openai.com
    from pydantic import BaseModel

    class Answer(BaseModel):
        sum: int = Field(ge=0, le=999)

    calls = []

    @agents.function_tool
    def add(a: Small, b: Small) -> int:
        """Add two numbers."""
        calls.append((a, b))
        return a + b

    def after_tools(ctx, results):
        # The model sees the tool output once (turn 2: "auto" + its output type,
        # one grammar); a random model may call again: then the tool's sum is the answer.
        final = len(calls) > 1
        return agents.ToolsToFinalOutputResult(final, Answer(sum=results[-1].output) if final else None)

    async def go(c):
        model = agents.OpenAIResponsesModel(model="tiny", openai_client=_openai(c))
        agent = agents.Agent(name="calc", instructions="Add the numbers.", tools=[add], output_type=Answer,
                             model=model, tool_use_behavior=after_tools, model_settings=agents.ModelSettings(
                                 tool_choice="required", temperature=0.0, max_tokens=300))
        return await agents.Runner.run(agent, "What is 2 plus 3?", max_turns=4)
    result = _run(api, go)
    assert calls and isinstance(result.final_output, Answer) and len(result.raw_responses) >= 2


def test_store_is_bounded_expires_and_survives_reopen(tmp_path):
    from conveyor.cluster.openai.responses_api.store import LocalResponseStore, SqliteResponses

    t = SqliteResponses(str(tmp_path / "r.sqlite3"), max_entries=3, ttl_s=100.0)
    for i in range(5):
        t.put(f"r{i}", json.dumps({"i": i}), now=1000.0 + i)
    assert len(t) == 3 and t.get("r1", now=1005.0) is None and t.get("r4", now=1005.0) == '{"i": 4}'
    assert t.get("r4", now=1105.0) is None  # past the TTL
    t.put("r9", "{}", now=1200.0)  # a put purges expired rows
    assert len(t) == 1 and t.delete("r9") and not t.delete("r9")
    t.put("keep", "{}")
    again = SqliteResponses(str(tmp_path / "r.sqlite3"), max_entries=3, ttl_s=100.0)
    assert again.get("keep") == "{}"  # another process (a restarted actor) sees it
    local = LocalResponseStore(2, 60.0)
    asyncio.run(local.put("a", {"x": 1}))
    assert asyncio.run(local.get("a")) == {"x": 1}


def test_tokenize_detokenize_and_model_card(api, ckpt):
    from conveyor.engine.frontend.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello"}]

    async def go(c):
        return [await c.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}),
                await c.post("/tokenize", json={"model": "tiny", "messages": msgs}),
                await c.post("/detokenize", json={"tokens": tok.encode("Hello world", add_special_tokens=False)}),
                await c.get("/v1/models/tiny"), await c.get("/v1/models/other"),
                await c.post("/tokenize", json={"prompt": "x", "model": "other"}),
                await c.post("/detokenize", json={"tokens": [10**9]}),
                await c.post("/tokenize", json={}),
                await c.post("/tokenize", json={"messages": []})]
    t, chat, d, card, unknown, bad_model, bad_ids, neither, no_messages = _run(api, go)
    ids = tok.encode("Hello world")
    assert t.json() == {"count": len(ids), "max_model_len": 2048, "tokens": ids,
                        "token_strs": [tok.decode([i], skip_special_tokens=False) for i in ids]}
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, msgs[1]])
    assert chat.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    assert d.json() == {"prompt": "Hello world"}
    assert card.json()["id"] == "tiny" and card.json()["object"] == "model"
    for r, status, code in [(unknown, 404, "model_not_found"), (bad_model, 404, "model_not_found"),
                            (bad_ids, 400, "invalid_value"), (neither, 400, "invalid_value"),
                            (no_messages, 400, "invalid_value")]:
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
