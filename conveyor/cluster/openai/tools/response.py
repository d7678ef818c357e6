"""Tool calling, response side: generated text -> `message.tool_calls`
(non-streaming) or OpenAI's tool-call deltas (streaming).

Streaming shape (what the openai client's stream helpers assemble): a call's
first delta carries index, id, type and function.name (arguments ""), later
ones carry function.arguments fragments. Under "auto" a call is sent once
the parser has settled it (its JSON complete and valid), so a stream never
announces a call the non-streamed response would not have; under
required/named (the grammar guarantees the format) the name goes out as soon
as it is complete and the arguments as they are generated. Content
whitespace is held until more content follows, so streamed content adds up
to the non-streamed one.
"""
from __future__ import annotations

import secrets
from itertools import zip_longest
from typing import Any

from conveyor.cluster.openai.tools.parsers import ArgsDelta, Content, Piece, ToolCall, ToolStream
from conveyor.cluster.openai.tools.request import ToolPlan


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class _ChoiceStream:
    """One streamed choice: the parser's state plus what was sent so far."""

    def __init__(self, stream: ToolStream, max_calls: int) -> None:
        self.stream, self.max_calls = stream, max_calls
        self.calls = 0  # calls sent; the next call's index
        self.open = False  # an eager call is being sent (its arguments go on index calls - 1)
        self.sent_content = False
        self.held_space = ""

    def deltas(self, pieces: list[Piece], final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = ""
        for p in pieces:
            if isinstance(p, Content):
                text += p.text
                continue
            text = self._content(out, text)
            if isinstance(p, ArgsDelta):
                if self.open:
                    out.append(_args_delta(self.calls - 1, p.text))
                continue
            self.open = self.calls < self.max_calls  # later calls are dropped
            if not self.open:
                continue
            out.append({"tool_calls": [{"index": self.calls, "id": call_id(), "type": "function",
                                        "function": {"name": p.name, "arguments": ""}}]})
            if isinstance(p, ToolCall):
                out.append(_args_delta(self.calls, p.arguments))
                self.open = False
            self.calls += 1
        self._content(out, text)
        if final and self.sent_content and self.held_space:
            out.append({"content": self.held_space})
            self.held_space = ""
        return out

    def _content(self, out: list[dict[str, Any]], text: str) -> str:
        text = self.held_space + text
        body = text.rstrip()
        self.held_space = text[len(body):]
        if body:
            out.append({"content": body})
            self.sent_content = True
        return ""


def _args_delta(index: int, text: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


class ToolSession:
    """A request's tool-call output handling (one per request)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.eager = plan.eager  # the grammar fixed the format
        # Eager streams read names only to complete a call cut before its name did.
        self.names = plan.forced if self.eager else plan.names
        self._streams: dict[int, _ChoiceStream] = {}

    def finish_choice(self, choice: dict[str, Any], text: str) -> dict[str, Any]:
        """A non-streamed chat choice: calls out of its content."""
        parsed = self.plan.parser.parse(text, self.names, self.eager)
        if parsed.calls:
            calls = parsed.calls[:self.plan.max_calls]
            choice["message"] = {"role": "assistant",
                                 "content": parsed.content if parsed.content.strip() else None,
                                 "tool_calls": [_call_json(c) for c in calls]}
            if choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        return choice

    def delta_choices(self, idx: int, choice: dict[str, Any], text: str) -> list[dict[str, Any]]:
        """The streamed chat choice `choice` (built for new text `text`) as
        one or more choice deltas: logprobs ride on the first, the finish on
        the last. [] when nothing can be said yet."""
        st = self._streams.get(idx)
        if st is None:
            stream = self.plan.parser.stream(self.names, self.eager)
            st = self._streams[idx] = _ChoiceStream(stream, self.plan.max_calls)
        final = choice["finish_reason"] is not None
        pieces = st.stream.feed(text) + (st.stream.finish() if final else [])
        deltas = st.deltas(pieces, final)
        if not deltas and not final and choice["logprobs"] is None:
            return []
        out = [{**choice, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas or [{}]]
        out[0]["logprobs"] = choice["logprobs"]
        for c in out[:-1]:
            c.pop("stop_reason", None)
        out[-1]["finish_reason"] = choice["finish_reason"]
        if final and st.calls and choice["finish_reason"] == "stop":
            out[-1]["finish_reason"] = "tool_calls"
        return out


def rounds(per_choice: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Choice deltas -> the choices of successive chunks: chunk k holds each
    choice's k-th delta, so every chunk names a choice at most once."""
    return [[c for c in r if c is not None] for r in zip_longest(*per_choice)]
