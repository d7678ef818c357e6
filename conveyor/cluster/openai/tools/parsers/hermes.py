"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as
Qwen (2.5, 3) and Hermes models emit; text around the calls is content.

A call left open when generation ends still counts if its JSON is complete
(some models stop right after the object)."""
from __future__ import annotations

from conveyor.cluster.openai.tools.parsers.base import (
    Content,
    EagerCall,
    Piece,
    ToolParser,
    ToolStream,
    call_from_json,
    call_header,
    held_prefix_len,
    partial_call,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ARGS_KEYS = ("arguments", "parameters")
_HEADER = call_header("arguments")


class HermesStream(ToolStream):
    def __init__(self, names: frozenset[str], eager: bool = False) -> None:
        super().__init__(names, eager)
        self.buf = ""  # text not yet settled; inside a call it is the call's body so far
        self.in_call = False
        self.call: EagerCall | None = None  # eager mode: the open call

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i < 0:
                    cut = len(self.buf) - held_prefix_len(self.buf, OPEN)
                    _content(out, self.buf[:cut])
                    self.buf = self.buf[cut:]
                    return out
                _content(out, self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(OPEN):], True
                self.call = EagerCall(_HEADER) if self.eager else None
            elif not self._close(out):
                return out

    def _close(self, out: list[Piece]) -> bool:
        """Settle the open call if its end is here; False while it is open."""
        args_end = 0
        if self.call is not None:
            pieces, args_end = self.call.feed(self.buf)
            out.extend(pieces)
            if args_end is None:
                return False
        j = self.buf.find(CLOSE, args_end)
        if j < 0:
            return False
        if self.call is None:
            out.append(self._settle(self.buf[:j], CLOSE))
        self.buf, self.in_call, self.call = self.buf[j + len(CLOSE):], False, None
        return True

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if not self.in_call:
            held = self.buf.lstrip()
            if self.eager and held and OPEN.startswith(held):  # cut inside the opening tag
                out.extend(partial_call("", self.names))
            else:
                _content(out, self.buf)
        elif self.call is None:
            out.append(self._settle(self.buf, ""))
        elif not self.call.started:  # eager, cut before the name was complete
            out.extend(partial_call(self.buf, self.names) or [Content(OPEN + self.buf)])
        self.buf, self.in_call, self.call = "", False, None
        return out

    def _settle(self, body: str, close: str) -> Piece:
        call = call_from_json(body.strip(), self.names, _ARGS_KEYS)
        return call if call is not None else Content(OPEN + body + close)


def _content(out: list[Piece], text: str) -> None:
    if text:
        out.append(Content(text))


class HermesParser(ToolParser):
    name = "hermes"
    stream_class = HermesStream
    call_separator = "\n"
    call_open = OPEN + "\n"
    call_close = "\n" + CLOSE
    args_key = "arguments"
