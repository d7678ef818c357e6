"""Tool calling over the OpenAI API (in process, no Ray), through the
official client: "required" and named tool_choice under the grammar (every
call valid: names in the set, arguments validating with jsonschema), "auto"
with the parser (noise stays content; a call forced by a regex is parsed),
"none", multi-turn rendering, streaming with the client's stream helper,
every error case, both parsers, batch lines."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from asgi_utils import openai_client, run_on
from llm_utils import make_checkpoint

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
# strict: the openai client's stream helper parses only strict tools' arguments.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}},
         {"type": "function", "function": {"name": "ping", "strict": True}}]  # no parameters: arguments {}
SCHEMAS = {"get_weather": WEATHER, "add": ADD,
           "ping": {"type": "object", "properties": {}, "additionalProperties": False}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # The tools' schemas make long prompts for a tokenizer trained on prose.
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("tools") / "llama"),
                           max_position_embeddings=2048)


@pytest.fixture(scope="module")
def api(ckpt):
    """(loop, {parser: FastAPI app}, AsyncLLM): one engine, one app per parser."""
    import msgspec

    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    cfg = build_config({"model": {"path": ckpt, "max_model_len": 2048},
                        "serve": {"served_model_name": "tiny"}})
    loop = asyncio.new_event_loop()
    llm = AsyncLLM(cfg)
    apps = {}
    for parser in ("hermes", "llama3_json"):
        c = msgspec.structs.replace(cfg, serve=msgspec.structs.replace(cfg.serve, tool_call_parser=parser))
        srv = OpenAIServer(llm, c)
        apps[parser] = build_api(srv, api_key=None)
        loop.run_until_complete(srv.start())
    yield loop, apps, llm
    loop.run_until_complete(llm.shutdown())
    loop.close()


def _run(api, coro_fn, parser: str = "hermes"):
    loop, apps, _ = api
    return run_on(loop, apps[parser], coro_fn)


_openai = openai_client


def _check_calls(choice, allowed: set[str], parallel: bool = True) -> list:
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for tc in calls:
        assert tc.type == "function" and tc.id.startswith("call_")
        assert tc.function.name in allowed
        jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
    assert len({tc.id for tc in calls}) == len(calls)
    return calls


REQUIRED_MODES = [("required", set(SCHEMAS)),
                  ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
                  ({"type": "function", "function": {"name": "add"}}, {"add"})]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice,allowed", REQUIRED_MODES)
def test_required_and_named_always_valid(api, parser, choice, allowed):
    async def go(c):
        client = _openai(c)
        reqs = [client.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=400,
            temperature=t, seed=seed) for t, seed in [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)]]
        return await asyncio.gather(*reqs)
    for comp in _run(api, go, parser):
        calls = _check_calls(comp.choices[0], allowed, parallel=choice == "required")
        if choice != "required":
            assert len(calls) == 1


def test_parallel_tool_calls_false_gives_one_call(api):
    async def go(c):
        client = _openai(c)
        return await asyncio.gather(*(client.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=400, temperature=1.0, seed=s, n=2) for s in range(3)))
    for comp in _run(api, go):
        for ch in comp.choices:
            _check_calls(ch, set(SCHEMAS), parallel=False)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice,allowed", REQUIRED_MODES[:2])
def test_streamed_calls_assemble_with_the_stream_helper(api, parser, choice, allowed):
    async def go(c):
        client = _openai(c)
        out = []
        for t, seed in [(0.0, None), (1.0, 7)]:
            async with client.chat.completions.stream(
                    model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=400,
                    temperature=t, seed=seed, stream_options={"include_usage": True}) as stream:
                chunks = [ev.chunk async for ev in stream if ev.type == "chunk"]
                out.append((await stream.get_final_completion(), chunks))
        # The same request, not streamed, greedy: the same calls.
        plain = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                                     tool_choice=choice, max_tokens=400, temperature=0.0)
        return out, plain
    out, plain = _run(api, go, parser)
    for comp, chunks in out:
        calls = _check_calls(comp.choices[0], allowed, parallel=choice == "required")
        assert comp.usage is not None and comp.usage.completion_tokens > 0
        firsts = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])
                  if tc.id is not None]
        assert len(firsts) == len(calls) and all(tc.function.name and tc.type == "function" for tc in firsts)
        fragments = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])
                     if tc.id is None]
        assert len(fragments) > len(calls)  # under the grammar, arguments stream as generated
    greedy = [(tc.function.name, tc.function.arguments) for tc in out[0][0].choices[0].message.tool_calls]
    assert greedy == [(tc.function.name, tc.function.arguments) for tc in plain.choices[0].message.tool_calls]


def test_auto_noise_is_content(api):
    async def go(c):
        client = _openai(c)
        comp = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                                    max_tokens=30, temperature=1.0, seed=0, n=3)
        stream = await client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                                      max_tokens=30, temperature=0.0, stream=True)
        parts = [(ch.delta.content or "", ch.delta.tool_calls, ch.finish_reason)
                 async for chunk in stream for ch in chunk.choices]
        return comp, parts
    comp, parts = _run(api, go)
    for ch in comp.choices:
        assert not ch.message.tool_calls and ch.message.content and ch.finish_reason in ("stop", "length")
    assert all(tc is None for _, tc, _ in parts) and "".join(p for p, _, _ in parts)
    assert parts[-1][2] in ("stop", "length")


FORCED = (r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", '
          r'"unit": "c"\}\}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_call_in_the_text(api, stream):
    """Auto mode's parser on real generation: a regex makes the tiny model write a hermes call."""
    async def go(c):
        client = _openai(c)
        kw = dict(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=120, temperature=1.0, seed=3,
                  extra_body={"structured_outputs": {"regex": FORCED}})
        if not stream:
            return await client.chat.completions.create(**kw)
        async with client.chat.completions.stream(**kw) as s:
            return await s.get_final_completion()
    comp = _run(api, go)
    ch = comp.choices[0]
    calls = _check_calls(ch, {"get_weather"})
    assert len(calls) == 1 and ch.message.content == "Sure. "


@pytest.mark.parametrize("parallel,expect", [(None, 2), (False, 1)])
def test_auto_parallel_tool_calls(api, parallel, expect):
    two = FORCED + r"\n" + FORCED[len(r"Sure\. "):]

    async def go(c):
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        return await _openai(c).chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, max_tokens=200, temperature=1.0, seed=4,
            extra_body={"structured_outputs": {"regex": two}}, **kw)
    ch = _run(api, go).choices[0]
    assert len(_check_calls(ch, {"get_weather"})) == expect


def test_tool_choice_none_returns_no_calls(api):
    async def go(c):
        client = _openai(c)
        return await client.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=120, temperature=1.0,
            seed=3, extra_body={"structured_outputs": {"regex": FORCED}})
    ch = _run(api, go).choices[0]
    assert not ch.message.tool_calls and ch.finish_reason == "stop"
    assert ch.message.content.startswith("Sure. <tool_call>")


def test_multi_turn_renders_and_generates(api, ckpt):
    from conveyor.engine.frontend.tokenizer import load_tokenizer

    history = [*MSGS,
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]

    async def go(c):
        client = _openai(c)
        return await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                    max_tokens=10, temperature=0.0)
    comp = _run(api, go)
    assert comp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tok = load_tokenizer(ckpt)
    text = tok.apply_chat_template(
        [history[0], {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
         history[2]], tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert "<|tool|>\n18 degrees, sunny</s>" in text and '"name": "get_weather", "description"' in text
    assert comp.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 6}},
          "required": ["answer"]}  # no additionalProperties: closed by default
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


@pytest.mark.parametrize("choice,allowed", REQUIRED_MODES[:2])
def test_forced_call_with_response_format_then_the_answer(api, choice, allowed):
    """required/named + response_format: this turn is the call; the turn after
    the tool result answers in the format (openai-agents sends its output type
    on every turn)."""
    async def go(c):
        client = _openai(c)
        first = await client.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=400,
            temperature=1.0, seed=5, response_format=ANSWER_FORMAT)
        call = first.choices[0].message.tool_calls[0]
        history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
        final = await client.chat.completions.create(
            model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=60,
            temperature=1.0, seed=5, response_format=ANSWER_FORMAT)
        return first, final
    first, final = _run(api, go)
    _check_calls(first.choices[0], allowed, parallel=choice == "required")
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    jsonschema.validate(json.loads(final.choices[0].message.content), {**ANSWER, "additionalProperties": False})


def test_auto_with_response_format_is_calls_or_the_answer(api, ckpt):
    """auto + response_format: one grammar admits a call (the parser's format)
    or the schema-shaped answer, nothing else; every output is one of them."""
    import llguidance as llg

    from conveyor.cluster.openai.protocol import ChatRequest
    from conveyor.cluster.openai.tools.request import tool_plan
    from conveyor.engine.frontend.tokenizer import load_tokenizer
    from conveyor.engine.structured_output.llguidance_backend import LLGuidanceBackend

    req = ChatRequest.model_validate({"messages": MSGS, "tools": TOOLS, "response_format": ANSWER_FORMAT})
    plan = tool_plan(req, "hermes", lambda so: None)
    assert plan.mode == "auto" and not plan.eager and plan.constraint is not None
    backend, tok = LLGuidanceBackend(ckpt, 512, None), load_tokenizer(ckpt)

    def admits(text: str) -> bool:
        m = llg.LLMatcher(backend.tokenizer, plan.constraint.grammar, log_level=0)
        ids = tok.encode(text, add_special_tokens=False)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()
    call = '<tool_call>\n{"name": "add", "arguments": {"a":1,"b":2}}\n</tool_call>'
    assert admits(call) and admits('{"answer":"hi"}')
    assert not admits('{"answer":"hi","x":1}') and not admits("hello") and not admits(call[:-3])

    async def go(c):
        return await _openai(c).chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, max_tokens=120, temperature=1.0, seed=2, n=4,
            response_format=ANSWER_FORMAT)
    for ch in _run(api, go).choices:
        if ch.message.tool_calls:
            _check_calls(ch, set(SCHEMAS))
        else:
            assert ch.finish_reason == "stop", ch
            jsonschema.validate(json.loads(ch.message.content), {**ANSWER, "additionalProperties": False})


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("max_tokens", [2, 9, 24])
def test_forced_call_cut_by_max_tokens_is_a_length_call(api, parser, max_tokens):
    """Cut anywhere (in the tag, the name, the arguments): finish_reason
    "length" and the partial call in tool_calls, never raw text; streamed the same."""
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def go(c):
        client = _openai(c)
        kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=named, max_tokens=max_tokens,
                  temperature=0.0)
        plain = await client.chat.completions.create(**kw)
        chunks = [ch async for ch in await client.chat.completions.create(stream=True, **kw)]
        return plain, chunks
    plain, chunks = _run(api, go, parser)
    ch = plain.choices[0]
    assert ch.finish_reason == "length" and not (ch.message.content or "").strip(), ch
    calls = [(tc.function.name, tc.function.arguments) for tc in ch.message.tool_calls]
    assert [name for name, _ in calls] == ["get_weather"]
    deltas = [c.delta for chunk in chunks for c in chunk.choices]
    assert not "".join(d.content or "" for d in deltas).strip()
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert [tc.function.name for tc in streamed if tc.id] == ["get_weather"]
    assert "".join(tc.function.arguments or "" for tc in streamed) == calls[0][1]
    assert [c.finish_reason for chunk in chunks for c in chunk.choices][-1] == "length"


def test_unparsable_echoed_arguments_and_developer_role(api):
    """LangChain echoes a truncated call verbatim: the template gets the text
    (no 400). `developer` renders as `system` on a template without it."""
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]

    async def go(c):
        client = _openai(c)
        turn = await client.chat.completions.create(model="tiny", messages=history, max_tokens=2)
        usage = []
        for role in ("developer", "system"):
            r = await client.chat.completions.create(
                model="tiny", messages=[{"role": role, "content": "Be brief."}, *MSGS], max_tokens=1)
            usage.append(r.usage.prompt_tokens)
        return turn, usage
    turn, (dev, system) = _run(api, go)
    assert turn.choices[0].finish_reason in ("stop", "length") and dev == system


BAD_TURN = [MSGS[0], {"role": "tool", "tool_call_id": "call_x", "content": "?"}]
ERRORS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string", "pattern": "(("}}}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x-guidance": 3, "type": "objekt"}}}]},
     "tools"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {  # grammar > 64 KiB
        "type": "object", "properties": {"x": {"enum": ["v" * 70_000]}}}}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "messages": BAD_TURN}, "messages"),
    ({"messages": BAD_TURN}, "messages"),
    ({"messages": [MSGS[0], {"role": "user", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "add", "arguments": "{}"}}]}]}, "messages"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize("body,param", ERRORS)
def test_errors_are_400_naming_the_field(api, body, param):
    _, _, llm = api

    async def go(c):
        bad = await c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **body})
        ok = await c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
        return bad, ok
    bad, ok = _run(api, go)
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert ok.status_code == 200 and llm.num_unfinished == 0


def test_tools_are_typed_in_the_openapi_schema(api):
    """FastAPI validates `tools` with the body (the errors above) and documents
    their shape: a client generator sees ToolDef, not an untyped list."""
    async def go(c):
        return (await c.get("/openapi.json")).json()["components"]["schemas"]
    schemas = _run(api, go)
    tools = schemas["ChatRequest"]["properties"]["tools"]["anyOf"][0]
    assert tools["items"] == {"$ref": "#/components/schemas/ToolDef"} and tools["maxItems"] == 128
    assert schemas["ToolDef"]["properties"]["type"]["const"] == "function"
    assert set(schemas["FunctionDef"]["required"]) == {"name"}


def test_batch_lines_with_tools(tmp_path, ckpt):
    from conveyor.cluster.batch.job import main

    cfg = tmp_path / "engine.yaml"
    cfg.write_text(json.dumps({"model": {"path": ckpt, "max_model_len": 2048},
                               "parallel": {"executor": "mp"}, "serve": {"served_model_name": "tiny"}}))
    named = {"type": "function", "function": {"name": "add"}}
    lines = [{"custom_id": "req", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400}},
             {"custom_id": "named", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": MSGS, "tools": TOOLS, "tool_choice": named, "max_tokens": 400}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": MSGS, "tool_choice": "required"}}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["--config", str(cfg), "--input", str(inp), "--output", str(out), "--no-progress"]) == 0
    recs = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    for cid in ("req", "named"):
        ch = recs[cid]["body"]["choices"][0]
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
        for tc in ch["message"]["tool_calls"]:
            jsonschema.validate(json.loads(tc["function"]["arguments"]), SCHEMAS[tc["function"]["name"]])
    assert [tc["function"]["name"] for tc in recs["named"]["body"]["choices"][0]["message"]["tool_calls"]] == ["add"]
    assert recs["bad"]["status_code"] == 400 and recs["bad"]["body"]["error"]["param"] == "tool_choice"
