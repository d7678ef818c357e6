"""Tool-call parsers as units, on fixed text: one and several calls,
surrounding text, malformed JSON, unknown names; streamed at every split
(two chunks at each boundary, and one character at a time) they must settle
exactly as the whole text does. Plus the streamed deltas' shape."""
from __future__ import annotations

import json

import pytest

from conveyor.cluster.openai.tools.parsers import TOOL_PARSERS, ToolCall, ToolSpec, get_tool_parser
from conveyor.cluster.openai.tools.parsers.base import fold

NAMES = frozenset({"get_weather", "add"})
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
A = '{"name": "add", "arguments": {"a": 1, "b": [2, "}"]}}'
GW = ToolCall("get_weather", '{"city": "Paris"}')
AD = ToolCall("add", '{"a": 1, "b": [2, "}"]}')

HERMES = [  # (text, content, calls)
    (f"<tool_call>\n{W}\n</tool_call>", "", [GW]),
    (f"Let me check.\n<tool_call>{W}</tool_call>\n<tool_call>{A}</tool_call> Done.",
     "Let me check.\n\n Done.", [GW, AD]),
    ("no calls at all, just < and <tool and tool_call>", "no calls at all, just < and <tool and tool_call>", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>ok',
     '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>ok', []),
    ('<tool_call>{"name": "launch_missiles", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "launch_missiles", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [ToolCall("add", '{"a": 1}')]),
    (f"x<tool_call>{W}", "x", [GW]),  # left open at the end, JSON complete
    ('x<tool_call>{"name": "add", "argu', 'x<tool_call>{"name": "add", "argu', []),
    ("trailing <tool_ca", "trailing <tool_ca", []),
    (f"<tool_call>{W}</tool_call><tool_call>not json</tool_call>",
     "<tool_call>not json</tool_call>", [GW]),
]

L3W = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
L3A = '{"name": "add", "parameters": {"a": 1, "b": [2, "}"]}}'
LLAMA3 = [
    (L3W, "", [GW]),
    (f"  {L3W}; {L3A}", "", [GW, AD]),
    (f"<|python_tag|>{L3A}", "", [AD]),
    (f"{L3W} and then some words", " and then some words", [GW]),
    (f"Sure: {L3W}", f"Sure: {L3W}", []),
    ('{"name": "get_weather", "parameters": {"city": ]}', '{"name": "get_weather", "parameters": {"city": ]}', []),
    (f'{L3W}; {{"name": "nope", "parameters": {{}}}}', '{"name": "nope", "parameters": {}}', [GW]),
    ('{"name": "add", "parameters": {"a"', '{"name": "add", "parameters": {"a"', []),
    ("<|python", "<|python", []),
    ("", "", []),
]

CASES = [("hermes", *c) for c in HERMES] + [("llama3_json", *c) for c in LLAMA3]


def _streamed(name: str, chunks: list[str]):
    s = get_tool_parser(name).stream(NAMES)
    pieces = [p for c in chunks for p in s.feed(c)] + s.finish()
    return fold(pieces)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parse(parser, text, content, calls):
    out = get_tool_parser(parser).parse(text, NAMES)
    assert out.content == content and out.calls == calls
    for c in out.calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_streaming_at_every_split(parser, text, content, calls):
    for i in range(len(text) + 1):
        out = _streamed(parser, [text[:i], text[i:]])
        assert (out.content, out.calls) == (content, calls), i
    out = _streamed(parser, list(text))  # one character at a time
    assert (out.content, out.calls) == (content, calls)


def test_a_call_is_never_announced_before_it_is_settled():
    s = get_tool_parser("hermes").stream(NAMES)
    text = f"<tool_call>{W}</tool_call>"
    seen = [s.feed(ch) for ch in text]
    assert all(not p for p in seen[:-1]) and seen[-1] == [GW]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_grammar_sentences_parse_back(parser):
    """A sentence of the grammar's shape (what constrained decoding emits) parses to its calls."""
    p = get_tool_parser(parser)
    g = p.grammar([ToolSpec("add", {"type": "object"}), ToolSpec("get_weather", {})], 8)
    assert g.startswith("start: call (") and "call){0,7}" in g and "%json" in g and "call_1" in g
    single = p.grammar([ToolSpec("add", {"type": "object"})], 1)
    assert single.startswith("start: call\n")
    if parser == "hermes":
        text = '<tool_call>\n{"name": "add", "arguments": {"a":1}}\n</tool_call>\n' \
               '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    else:
        text = '{"name": "add", "parameters": {"a":1}}; {"name": "get_weather", "parameters": {}}'
    out = p.parse(text, NAMES)
    assert out.calls == [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", "{}")] and not out.content.strip()


def test_registry_matches_config():
    from conveyor.engine.config import TOOL_CALL_PARSERS, ConfigError, build_config

    assert set(TOOL_PARSERS) == set(TOOL_CALL_PARSERS)
    assert build_config({"serve": {"tool_call_parser": "llama3_json"}}).serve.tool_call_parser == "llama3_json"
    with pytest.raises(ConfigError, match="serve.tool_call_parser: expected one of hermes/llama3_json"):
        build_config({"serve": {"tool_call_parser": "mistral"}})
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("mistral")


def _plan(parser: str = "hermes", max_calls: int = 8):
    from conveyor.cluster.openai.tools.request import ToolPlan

    return ToolPlan("auto", get_tool_parser(parser), NAMES, None, max_calls)


def _accumulate(chunks: list[list[dict]]) -> dict:
    """Assemble deltas the way the openai client's stream helpers do."""
    msg: dict = {"content": None, "tool_calls": {}}
    finish = None
    for choices in chunks:
        assert len({c["index"] for c in choices}) == len(choices)  # a choice at most once a chunk
        for c in choices:
            d = c["delta"]
            if d.get("content") is not None:
                msg["content"] = (msg["content"] or "") + d["content"]
            for tc in d.get("tool_calls", []):
                slot = msg["tool_calls"].get(tc["index"])
                if slot is None:  # the first delta of a call names it
                    assert {"id", "type"} <= set(tc) and tc["function"]["name"]
                    slot = msg["tool_calls"][tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"],
                                                            "arguments": ""}
                else:
                    assert "name" not in tc["function"] and "id" not in tc
                slot["arguments"] += tc["function"].get("arguments", "")
            finish = c["finish_reason"] or finish
    return {"content": msg["content"], "calls": [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])],
            "finish": finish}


@pytest.mark.parametrize("max_calls", [8, 1])
@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_session_deltas_assemble_to_the_final_message(parser, text, content, calls, max_calls):
    """Streamed one character a time, the deltas add up to the non-streamed
    message; parallel_tool_calls false (max_calls 1) keeps the first call only."""
    from conveyor.cluster.openai import bodies as B
    from conveyor.cluster.openai.tools.response import ToolSession, rounds

    calls = calls[:max_calls]
    final = ToolSession(_plan(parser, max_calls)).finish_choice(B.chat_choice(0, text, None, "stop"), text)
    s = ToolSession(_plan(parser, max_calls))
    chunks = []
    for i, ch in enumerate(text or " "):
        last = i == max(len(text), 1) - 1
        base = B.chat_delta(0, {"content": ch}, None, "stop" if last else None, None)
        chunks += rounds([s.delta_choices(0, base, ch if text else "")])
    got = _accumulate(chunks)
    msg = final["message"]
    assert got["finish"] == final["finish_reason"] == ("tool_calls" if calls else "stop")
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [(c.name, c.arguments) for c in calls]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])] == \
        [(c.name, c.arguments) for c in calls]
    expect = msg["content"]
    assert (got["content"] or None) == (expect or None)
    for c in msg.get("tool_calls", []):
        assert c["id"].startswith("call_") and len(c["id"]) > 10 and c["type"] == "function"


# ---- eager reading (required/named: the grammar fixed the format) ---------------------

GRAMMAR_TEXT = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a":1,"b":[2,"}\\""]}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a":1,"b":[2,"}\\""]}}; '
                   '{"name": "get_weather", "parameters": {}}',
}
EAGER_CALLS = [ToolCall("add", '{"a":1,"b":[2,"}\\""]}'), ToolCall("get_weather", "{}")]


@pytest.mark.parametrize("parser", sorted(GRAMMAR_TEXT))
def test_eager_reading_at_every_split(parser):
    text = GRAMMAR_TEXT[parser]
    p = get_tool_parser(parser)
    whole = p.parse(text, NAMES, eager=True)
    assert whole.calls == EAGER_CALLS and not whole.content.strip()  # arguments verbatim
    for i in range(len(text) + 1):
        s = p.stream(NAMES, eager=True)
        out = fold(s.feed(text[:i]) + s.feed(text[i:]) + s.finish())
        assert out.calls == EAGER_CALLS and not out.content.strip(), i
    # Cut off by max_tokens inside the arguments: the call keeps what it got.
    cut = text.index('"b"')
    assert p.parse(text[:cut], NAMES, eager=True).calls == [ToolCall("add", '{"a":1,')]


@pytest.mark.parametrize("parser", sorted(GRAMMAR_TEXT))
def test_eager_deltas_name_first_then_argument_fragments(parser):
    from conveyor.cluster.openai import bodies as B
    from conveyor.cluster.openai.tools.request import ToolPlan
    from conveyor.cluster.openai.tools.response import ToolSession, rounds
    from conveyor.engine.structured_output.params import StructuredOutputsParams

    plan = ToolPlan("required", get_tool_parser(parser), NAMES, StructuredOutputsParams(grammar='start: "x"'))
    text = GRAMMAR_TEXT[parser]
    s, chunks = ToolSession(plan), []
    for i, ch in enumerate(text):
        reason = "stop" if i == len(text) - 1 else None
        chunks += rounds([s.delta_choices(0, B.chat_delta(0, {"content": ch}, None, reason), ch)])
        if i == text.index('"a"') + 1:  # inside the first call's arguments: its name is out
            assert _accumulate(chunks)["calls"][0]["name"] == "add"
    got = _accumulate(chunks)
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [(c.name, c.arguments) for c in EAGER_CALLS]
    assert got["finish"] == "tool_calls" and got["content"] is None
    fragments = [tc for ch in chunks for c in ch for tc in c["delta"].get("tool_calls", [])
                 if "id" not in tc]
    assert len(fragments) > len(EAGER_CALLS)  # the arguments arrive piece by piece
    final = ToolSession(plan).finish_choice(B.chat_choice(0, text, None, "stop"), text)
    assert [c["function"]["arguments"] for c in final["message"]["tool_calls"]] == \
        [c.arguments for c in EAGER_CALLS]


@pytest.mark.parametrize("parser", sorted(GRAMMAR_TEXT))
def test_eager_cut_anywhere_is_a_call_never_content(parser):
    """max_tokens may cut a forced call in its tag or its name: still a call
    (the one name the text can become), with the arguments it got."""
    text = GRAMMAR_TEXT[parser]
    p = get_tool_parser(parser)
    end = text.index("}}") + 1
    for i in range(1, end):
        one = p.parse(text[:i], frozenset({"add"}), eager=True)
        assert [c.name for c in one.calls] == ["add"] and not one.content.strip(), (i, one)
        two = p.parse(text[:i], frozenset({"add", "get_weather"}), eager=True)
        assert len(two.calls) == 1 and two.calls[0].name in ("", "add") and not two.content.strip(), i
