"""Tool-call parsers behind a registry; `serve.tool_call_parser` picks one.

A parser turns generated text into content and tool calls (incrementally,
for streaming) and writes the Lark grammar that makes "required" and named
tool_choice produce calls in its own format, so one parser reads both."""
from __future__ import annotations

from conveyor.cluster.openai.tools.parsers.base import (
    ArgsDelta,
    CallStart,
    Content,
    ParsedMessage,
    Piece,
    ToolCall,
    ToolParser,
    ToolSpec,
    ToolStream,
)
from conveyor.cluster.openai.tools.parsers.hermes import HermesParser
from conveyor.cluster.openai.tools.parsers.llama3_json import Llama3JsonParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "ArgsDelta", "CallStart", "Content", "ParsedMessage", "Piece", "ToolCall", "ToolParser",
           "ToolSpec", "ToolStream", "get_tool_parser"]
