"""llama3_json: Llama 3.1+'s JSON tool calls, a bare object
`{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
several separated by `;`. Output that does not start with an object is plain
content; once a call fails to parse, the rest of the text is content."""
from __future__ import annotations

from cluster.tool_parsers.base import (Content, Piece, ToolParser, ToolSpec, ToolStream,
                                       call_from_json, call_rules, repeat)

PYTHON_TAG = "<|python_tag|>"
_ARGS_KEYS = ("parameters", "arguments")
_START, _CALLS, _CONTENT = "start", "calls", "content"


class _ObjectEnd:
    """Finds where a top-level JSON object ends, incrementally (strings and
    escapes respected); says nothing about whether the JSON is valid."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.pos = 0, False, False, 0

    def scan(self, text: str) -> int | None:
        """Index just past the object in `text` (the same, growing text each
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
                    return i + 1
        self.pos = len(text)
        return None


class Llama3JsonStream(ToolStream):
    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.buf, self.state, self.end = "", _START, _ObjectEnd()

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        if self.state == _START:
            self._decide()
        while self.state == _CALLS:
            body = self.buf.lstrip(" \t\r\n;")
            if not body:
                break
            if not body.startswith("{"):
                self.state = _CONTENT
                break
            self.buf, self.end = body, self.end if self.buf == body else _ObjectEnd()
            stop = self.end.scan(self.buf)
            if stop is None:
                break
            call = call_from_json(self.buf[:stop], self.names, _ARGS_KEYS)
            if call is None:
                self.state = _CONTENT
                break
            out.append(call)
            self.buf, self.end = self.buf[stop:], _ObjectEnd()
        if self.state == _CONTENT and self.buf:
            out.append(Content(self.buf))
            self.buf = ""
        return out

    def _decide(self) -> None:
        head = self.buf.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return  # not known yet
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG):]
            self.state = _CALLS
        else:
            self.state = _CALLS if head.startswith("{") else _CONTENT
            if self.state == _CONTENT:
                return  # keep the text as written, leading whitespace included
        self.buf = head

    def finish(self) -> list[Piece]:
        # Held text: undecided start, an open object, or separators after the last call.
        rest = self.buf if self.state != _CALLS or self.buf.strip(" \t\r\n;") else ""
        self.buf, self.state = "", _CONTENT
        return [Content(rest)] if rest else []


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def stream(self, names: frozenset[str]) -> ToolStream:
        return Llama3JsonStream(names)

    def grammar(self, tools: list[ToolSpec], max_calls: int) -> str:
        start = repeat("; ", max_calls)
        return "\n".join([start, *call_rules(tools, "", "", "parameters")]) + "\n"
