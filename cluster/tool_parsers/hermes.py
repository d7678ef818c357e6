"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as
Qwen (2.5, 3) and Hermes models emit; text around the calls is content.

A call left open when generation ends still counts if its JSON is complete
(some models stop right after the object)."""
from __future__ import annotations

from cluster.tool_parsers.base import (Content, Piece, ToolParser, ToolSpec, ToolStream,
                                       call_from_json, call_rules, repeat, held_prefix_len)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ARGS_KEYS = ("arguments", "parameters")


class HermesStream(ToolStream):
    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.buf = ""  # text not yet settled; inside a call it is the call's body so far
        self.in_call = False

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
            else:
                j = self.buf.find(CLOSE)
                if j < 0:
                    return out
                out.append(self._settle(self.buf[:j], CLOSE))
                self.buf, self.in_call = self.buf[j + len(CLOSE):], False

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.in_call:
            out.append(self._settle(self.buf, ""))
        else:
            _content(out, self.buf)
        self.buf, self.in_call = "", False
        return out

    def _settle(self, body: str, close: str) -> Piece:
        call = call_from_json(body.strip(), self.names, _ARGS_KEYS)
        return call if call is not None else Content(OPEN + body + close)


def _content(out: list[Piece], text: str) -> None:
    if text:
        out.append(Content(text))


class HermesParser(ToolParser):
    name = "hermes"

    def stream(self, names: frozenset[str]) -> ToolStream:
        return HermesStream(names)

    def grammar(self, tools: list[ToolSpec], max_calls: int) -> str:
        start = repeat("\n", max_calls)
        return "\n".join([start, *call_rules(tools, OPEN + "\n", "\n" + CLOSE, "arguments")]) + "\n"
