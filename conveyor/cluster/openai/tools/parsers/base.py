"""What every tool-call parser shares: the parsed pieces, the parser contract
and small helpers for JSON call objects and Lark grammars.

Two ways to read calls:
- settled (tool_choice "auto": the model is free): a call comes out whole
  (`ToolCall`, arguments re-serialized) once its JSON is complete and valid;
  until then its text is held, and text that looks like a call but is not one
  (bad JSON, unknown tool name, arguments that are not an object) comes back
  as content, verbatim.
- eager (required/named: the grammar fixed the format, so nothing can turn
  out invalid): `CallStart` once the name is complete, then `ArgsDelta`s with
  the argument text as it arrives, verbatim.

Invariants:
- One code path: `parse(text)` is a stream fed the whole text at once, so a
  streamed response and a non-streamed one split the same text the same way.
- Parsing never raises on model output.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    text: str


Piece = ToolCall | Content | CallStart | ArgsDelta


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the grammar needs it: its name and its arguments' schema."""
    name: str
    parameters: dict[str, Any]


@dataclass
class ParsedMessage:
    content: str = ""  # the text outside the calls, in order
    calls: list[ToolCall] = field(default_factory=list)


class ToolStream(ABC):
    """Incremental parser state for one choice: feed text deltas, get pieces
    whose meaning is settled. Text that might still become a call is held."""

    def __init__(self, names: frozenset[str], eager: bool = False) -> None:
        self.names = names  # settled mode: calls to other names are content
        self.eager = eager

    @abstractmethod
    def feed(self, text: str) -> list[Piece]: ...

    @abstractmethod
    def finish(self) -> list[Piece]:
        """The generation ended: settle whatever is held."""


class ToolParser:
    """A format: its stream class and the pieces of its call grammar. A
    parser is these class attributes; the behaviour lives in its stream."""
    name: ClassVar[str]
    stream_class: ClassVar[type[ToolStream]]
    call_separator: ClassVar[str]  # text between two calls in the grammar
    call_open: ClassVar[str]  # text before each call object ("" for none)
    call_close: ClassVar[str]  # text after each call object
    args_key: ClassVar[str]  # the key the grammar writes the arguments under

    def stream(self, names: frozenset[str], eager: bool = False) -> ToolStream:
        return self.stream_class(names, eager)

    def grammar(self, tools: list[ToolSpec], max_calls: int) -> str:
        """A Lark grammar (llguidance dialect) whose sentences are 1..max_calls
        calls to `tools` in this parser's format, each call's arguments valid
        for its tool's parameters."""
        start = repeat(self.call_separator, max_calls)
        rules = call_rules(tools, self.call_open, self.call_close, self.args_key)
        return "\n".join([start, *rules]) + "\n"

    def grammar_or_json(self, tools: list[ToolSpec], max_calls: int, schema: dict[str, Any]) -> str:
        """A Lark grammar whose sentences are grammar(tools, max_calls)'s, or
        one JSON value valid for `schema` (tool_choice "auto" with a JSON
        response format: the model calls tools or answers in that shape)."""
        calls = self.grammar(tools, max_calls)
        head = "start:"
        if not calls.startswith(head):  # every parser's grammar opens with its start rule
            raise ValueError(f"{self.name}: the call grammar does not open with its start rule")
        return (f"start: calls | answer\nanswer: %json {compact_schema(schema)}\n"
                f"calls:{calls[len(head):]}")

    def parse(self, text: str, names: frozenset[str], eager: bool = False) -> ParsedMessage:
        s = self.stream(names, eager)
        return fold(s.feed(text) + s.finish())


def fold(pieces: Iterable[Piece]) -> ParsedMessage:
    """Pieces -> the message. An eager call cut off by max_tokens keeps the
    arguments it got (what a streaming client assembled too)."""
    out = ParsedMessage()
    for p in pieces:
        if isinstance(p, ToolCall):
            out.calls.append(p)
        elif isinstance(p, CallStart):
            out.calls.append(ToolCall(p.name, ""))
        elif isinstance(p, ArgsDelta):
            out.calls[-1] = ToolCall(out.calls[-1].name, out.calls[-1].arguments + p.text)
        else:
            out.content += p.text
    return out


class ObjectEnd:
    """Finds where a JSON object or array starting at `start` ends,
    incrementally (strings and escapes respected); says nothing about
    whether the JSON is valid."""

    def __init__(self, start: int = 0) -> None:
        self.depth, self.in_str, self.esc, self.pos = 0, False, False, start

    def scan(self, text: str) -> int | None:
        """Index just past the value in `text` (the same, growing text each
        call), or None while it is still open."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


def call_header(args_key: str) -> re.Pattern[str]:
    """`{"name": "N", "<args_key>": ` up to the arguments' opening brace."""
    return re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"' + args_key
                      + r'"\s*:\s*(?=\{)')


class EagerCall:
    """One call read eagerly, from the text just after its opening: the name
    once the header is complete, then the argument text as it arrives."""

    def __init__(self, header: re.Pattern[str]) -> None:
        self.header = header
        self.started = False
        self.end: ObjectEnd | None = None
        self.sent = 0  # argument text sent up to here
        self.args_end: int | None = None

    def feed(self, buf: str) -> tuple[list[Piece], int | None]:
        """`buf`: the call's text so far (growing). Returns new pieces and,
        once the arguments are complete, the index just past them."""
        out: list[Piece] = []
        if not self.started:
            m = self.header.match(buf)
            if m is None:
                return out, None
            self.started, self.sent, self.end = True, m.end(), ObjectEnd(m.end())
            out.append(CallStart(m.group(1)))
        if self.args_end is None:
            assert self.end is not None
            stop = self.end.scan(buf)
            upto = stop if stop is not None else len(buf)
            if upto > self.sent:
                out.append(ArgsDelta(buf[self.sent:upto]))
                self.sent = upto
            self.args_end = stop
        return out, self.args_end


def call_from_json(text: str, names: frozenset[str], args_keys: tuple[str, ...]) -> ToolCall | None:
    """`{"name": N, <args key>: {...}}` -> a call, or None when `text` is not
    exactly that (arguments may also come as the JSON text of an object)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args: Any = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_NAME_HEAD = '{"name": "'  # how every call grammar (call_rules) opens a call


def partial_call(text: str, names: frozenset[str]) -> list[Piece]:
    """An eager (required/named) call cut off before its name was complete:
    the call it was becoming, with no arguments yet (OpenAI's shape for a call
    cut by max_tokens). The name: the one name of `names` the text can still
    become, else what the text has of it. [] when `text` is not a call's start
    ("" is one: the caller knows a call had begun)."""
    body = text.lstrip()
    if _NAME_HEAD.startswith(body):
        prefix = ""
    elif body.startswith(_NAME_HEAD):
        prefix = body[len(_NAME_HEAD):].split('"', 1)[0]
    else:
        return []
    fits = sorted(n for n in names if n.startswith(prefix))
    return [CallStart(fits[0] if len(fits) == 1 else prefix)]


def held_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`
    (text that may still turn into the tag once more arrives)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def lark_literal(text: str) -> str:
    # JSON string escaping is valid Lark string-literal escaping.
    return json.dumps(text, ensure_ascii=False)


def compact_schema(schema: dict[str, Any]) -> str:
    """A schema for `%json`, with no whitespace allowed between JSON tokens
    (a weak model would otherwise loop in whitespace until max_tokens)."""
    given = schema.get("x-guidance")
    guidance = {**(given if isinstance(given, dict) else {}), "whitespace_flexible": False}
    return json.dumps({**schema, "x-guidance": guidance}, ensure_ascii=False)


def repeat(sep: str, max_calls: int) -> str:
    """The start rule: 1..max_calls calls separated by `sep`."""
    more = f" ({lark_literal(sep)} call){{0,{max_calls - 1}}}" if max_calls > 1 else ""
    return f"start: call{more}"


def call_rules(tools: list[ToolSpec], head: str, tail: str, args_key: str) -> list[str]:
    """Lark rules `call: call_0 | call_1 ...`, one alternative per tool:
    head + {"name": "N", "<args_key>": <args>} + tail."""
    alts, rules = [], []
    for i, t in enumerate(tools):
        prefix = f'{head}{{"name": {json.dumps(t.name)}, "{args_key}": '
        rules.append(f"call_{i}: {lark_literal(prefix)} args_{i} {lark_literal('}' + tail)}")
        rules.append(f"args_{i}: %json {compact_schema(t.parameters)}")
        alts.append(f"call_{i}")
    return [f"call: {' | '.join(alts)}", *rules]
