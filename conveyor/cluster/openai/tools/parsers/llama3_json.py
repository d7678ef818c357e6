"""llama3_json: Llama 3.1+'s JSON tool calls, a bare object
`{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
several separated by `;`. Output that does not start with an object is plain
content; once a call fails to parse, the rest of the text is content."""
from __future__ import annotations

from conveyor.cluster.openai.tools.parsers.base import (
    Content,
    EagerCall,
    ObjectEnd,
    Piece,
    ToolParser,
    ToolStream,
    call_from_json,
    call_header,
    partial_call,
)

PYTHON_TAG = "<|python_tag|>"
_ARGS_KEYS = ("parameters", "arguments")
_HEADER = call_header("parameters")
_SEPARATORS = " \t\r\n;"
_START, _CALLS, _CONTENT = "start", "calls", "content"


class Llama3JsonStream(ToolStream):
    def __init__(self, names: frozenset[str], eager: bool = False) -> None:
        super().__init__(names, eager)
        self.buf, self.state = "", _START
        self.end: ObjectEnd | None = None  # settled mode: the open object
        self.call: EagerCall | None = None  # eager mode: the open call

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        if self.state == _START:
            self._decide()
        while self.state == _CALLS and self._next_call(out):
            pass
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
        elif not head.startswith("{"):
            self.state = _CONTENT  # kept as written, leading whitespace included
            return
        self.buf, self.state = head, _CALLS

    def _next_call(self, out: list[Piece]) -> bool:
        """Read one call off the front of buf; False while it is incomplete."""
        if self.end is None and self.call is None:
            body = self.buf.lstrip(_SEPARATORS)
            if not body:
                return False
            if not body.startswith("{"):
                self.state = _CONTENT
                return False
            self.buf = body
            self.end, self.call = (None, EagerCall(_HEADER)) if self.eager else (ObjectEnd(), None)
        if self.call is not None:
            return self._eager(out)
        assert self.end is not None
        stop = self.end.scan(self.buf)
        if stop is None:
            return False
        call = call_from_json(self.buf[:stop], self.names, _ARGS_KEYS)
        if call is None:
            self.state = _CONTENT
            return False
        out.append(call)
        self.buf, self.end = self.buf[stop:], None
        return True

    def _eager(self, out: list[Piece]) -> bool:
        assert self.call is not None
        pieces, args_end = self.call.feed(self.buf)
        out.extend(pieces)
        if args_end is None:
            return False
        rest = self.buf[args_end:].lstrip()
        if not rest:
            return False
        if rest[0] != "}":  # not the grammar's shape: what is left is content
            self.buf, self.state = rest, _CONTENT
            return False
        self.buf, self.call = rest[1:], None
        return True

    def finish(self) -> list[Piece]:
        # Held text: undecided start, an open object, or separators after the last call.
        cut: list[Piece] = []
        if self.eager and self.call is None and self.state == _START and self.buf.strip():
            cut = partial_call("", self.names)  # cut inside <|python_tag|>
        elif self.eager and self.call is not None and not self.call.started:
            cut = partial_call(self.buf, self.names)  # cut before the name was complete
        if cut:
            rest = ""
        elif self.call is not None and self.call.started:
            rest = ""  # an eager call cut off: its arguments so far were sent
        elif self.state != _CALLS or self.buf.strip(_SEPARATORS):
            rest = self.buf
        else:
            rest = ""
        self.buf, self.state, self.end, self.call = "", _CONTENT, None, None
        return cut + ([Content(rest)] if rest else [])


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    stream_class = Llama3JsonStream
    call_separator = "; "
    call_open = ""
    call_close = ""
    args_key = "parameters"
