"""Tool calling, request side: check `tool_choice` and the tool turns of
`messages` (`tools` come validated with the body: protocol.Tools), render
them for the chat template, and build the grammar that "required"/named
choices run under.

Invariants:
- Every client mistake is a 400 naming the field (`tools`, `tool_choice`,
  `messages`) before anything is queued; every tool's `parameters` schema is
  compile-checked whatever the choice, so a broken one never waits for the
  request that would have needed it.
- A ToolPlan exists only when calls may come back (tools given and
  tool_choice is not "none"); without one the response is plain content.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from conveyor.cluster.openai import errors as E
from conveyor.cluster.openai import protocol as P
from conveyor.cluster.openai.structured_request import structured_outputs_of
from conveyor.cluster.openai.tools.parsers import ToolParser, ToolSpec, get_tool_parser
from conveyor.engine.frontend.json_limits import JSONLimitError, check_json_value
from conveyor.engine.structured_output.params import StructuredOutputsParams
from conveyor.engine.structured_output.schema import close_objects

# No parameters: the call takes none (and a weak model cannot invent keys forever).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# Calls per choice under "required": a weak model in a grammar that allows
# unbounded calls can append calls until max_tokens cuts the last one off.
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output becomes tool calls."""
    mode: str  # "auto" | "required" | "named"
    parser: ToolParser
    names: frozenset[str]
    # The grammar: the calls for required/named; under "auto" with a JSON
    # response_format, calls or the schema-shaped answer; else None.
    constraint: StructuredOutputsParams | None
    max_calls: int = MAX_PARALLEL_CALLS  # 1 with parallel_tool_calls false; later calls are dropped
    forced: frozenset[str] = frozenset()  # required/named: the names the grammar admits

    @property
    def eager(self) -> bool:
        """The grammar fixes the calls' format (required/named): read them eagerly."""
        return self.mode != "auto"


def _validate(cls: type[BaseModel], obj: Any, param: str, where: str) -> Any:
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        detail = e.errors()[0]
        loc = ".".join(str(p) for p in detail.get("loc", ()))
        raise E.bad_request(f"{where}{'.' + loc if loc else ''}: {detail.get('msg')}", param) from None


def tool_specs(req: P.ChatRequest) -> list[ToolSpec]:
    """The request's tools (their shape, names and count were validated with
    the body: protocol.Tools); no parameters means none."""
    return [ToolSpec(t.function.name, t.function.parameters if t.function.parameters is not None
                     else _NO_PARAMETERS) for t in req.tools or ()]


def _choice(req: P.ChatRequest, specs: list[ToolSpec]) -> tuple[str, str | None]:
    """(mode, tool name for "named"); "auto" is the default with tools, "none" without."""
    tc = req.tool_choice
    if tc is None:
        return ("auto" if specs else "none"), None
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise E.bad_request(f"tool_choice must be none, auto, required or a named function; "
                                f"got {tc!r}", "tool_choice")
        if tc == "required" and not specs:
            raise E.bad_request('tool_choice "required" needs tools', "tool_choice")
        return tc if specs or tc == "none" else "none", None
    name = _validate(P.NamedToolChoice, tc, "tool_choice", "tool_choice").function.name
    if all(s.name != name for s in specs):
        raise E.bad_request(f"tool_choice names function {name!r}, which is not among tools",
                            "tool_choice")
    return "named", name


def tool_plan(req: P.ChatRequest, parser_name: str,
              check: Callable[[StructuredOutputsParams], None],
              allow_additional_properties: bool = False) -> ToolPlan | None:
    """Validate the tool fields; `check` compile-checks a constraint (ValueError).
    allow_additional_properties False: every schema is closed (structured_outputs
    config; conveyor/engine/structured_output/schema.py)."""
    specs = tool_specs(req)
    mode, named = _choice(req, specs)
    if not specs:
        return None
    if not allow_additional_properties:
        specs = [ToolSpec(s.name, close_objects(s.parameters)) for s in specs]
    parser = get_tool_parser(parser_name)
    max_calls = 1 if req.parallel_tool_calls is False else MAX_PARALLEL_CALLS
    everything = _compile_check(check, lambda: StructuredOutputsParams(grammar=parser.grammar(specs, max_calls)),
                                "tools", "the tools do not compile to a grammar")
    if mode == "none":
        return None
    names = frozenset(s.name for s in specs)
    answer = structured_outputs_of(req.response_format, req.structured_outputs)
    if mode == "auto":
        if answer is not None and answer.kind not in ("json", "json_object"):
            # A regex, choice or grammar (vLLM's structured_outputs) governs the
            # raw text, as in vLLM; the parser still finds calls written in it.
            return ToolPlan(mode, parser, names, None, max_calls)
        # One grammar: the calls, or the answer in the requested JSON shape.
        constraint = None if answer is None else _compile_check(
            check, lambda: _calls_or_answer(req, parser, specs, max_calls, answer, allow_additional_properties),
            "response_format", "the tools and the response format do not compile to one grammar")
        return ToolPlan(mode, parser, names, constraint, max_calls)
    # required/named: the call is constrained; a response_format is for the
    # final answer of a later turn (OpenAI accepts both at once).
    chosen = [s for s in specs if s.name == named] if mode == "named" else specs
    constraint = everything if mode == "required" else _compile_check(
        check, lambda: StructuredOutputsParams(grammar=parser.grammar(chosen, 1)), "tools",
        "the tools do not compile to a grammar")
    return ToolPlan(mode, parser, names, constraint, max_calls, frozenset(s.name for s in chosen))


def _compile_check(check: Callable[[StructuredOutputsParams], None],
                   build: Callable[[], StructuredOutputsParams], param: str,
                   what: str) -> StructuredOutputsParams:
    """build() and compile-check a constraint; a ValueError (too long a grammar,
    a schema llguidance refuses) is a 400 naming `param`. APIErrors pass."""
    try:
        so = build()
        check(so)
    except ValueError as e:
        raise E.bad_request(f"{what}: {e}", param) from None
    return so


def _calls_or_answer(req: P.ChatRequest, parser: ToolParser, specs: list[ToolSpec], max_calls: int,
                     answer: StructuredOutputsParams, allow_additional: bool) -> StructuredOutputsParams:
    """The "auto" grammar with a JSON answer format (json_schema / json_object)."""
    if answer.kind == "json_object":
        schema: Any = {"type": "object"}
    elif answer.kind == "json":
        schema = json.loads(answer.json) if isinstance(answer.json, str) else answer.json
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be an object")
        schema = schema if allow_additional else close_objects(schema)
    else:
        param = "structured_outputs" if req.structured_outputs is not None else "response_format"
        raise E.bad_request(f"with tools under tool_choice \"auto\", only a JSON answer format "
                            f"(json_schema or json_object) can be combined; got {answer.kind}", param)
    return StructuredOutputsParams(grammar=parser.grammar_or_json(specs, max_calls, schema))


# ---- the chat template's input ---------------------------------------------------------

def template_input(req: P.ChatRequest, template: str | None = None
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables). Assistant tool calls carry their
    arguments as objects (what HF templates render with `tojson`); a tool
    message must answer a call made earlier in the conversation. `template`:
    the chat template's source; one that never mentions the `developer` role
    gets those turns as `system` (OpenAI's newer name for it)."""
    messages = P.render_messages(req)
    if template is not None and "developer" not in template:
        for d in messages:
            if d["role"] == "developer":
                d["role"] = "system"
    seen: set[str] = set()
    for i, (m, d) in enumerate(zip(req.messages, messages)):
        if m.tool_calls:
            if m.role != "assistant":
                raise E.bad_request(f"messages[{i}]: only assistant messages carry tool_calls",
                                    "messages")
            d["tool_calls"] = [_rendered_call(i, c, seen) for c in m.tool_calls]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise E.bad_request(f"messages[{i}]: a tool message needs tool_call_id", "messages")
            if m.tool_call_id not in seen:
                raise E.bad_request(f"messages[{i}].tool_call_id {m.tool_call_id!r} matches no "
                                    "earlier tool call", "messages")
            d["tool_call_id"] = m.tool_call_id
    # HF's variable: the tools as sent (the fields the client set, in OpenAI's order).
    extra = {"tools": [t.model_dump(exclude_unset=True) for t in req.tools]} if req.tools else {}
    return messages, extra


def _rendered_call(i: int, raw: Any, seen: set[str]) -> dict[str, Any]:
    call = _validate(P.AssistantToolCall, raw, "messages", f"messages[{i}].tool_calls")
    try:
        args: Any = json.loads(call.function.arguments)
        check_json_value(args, f"messages[{i}].tool_calls.arguments")  # nesting the template can render
    except JSONLimitError as e:
        raise E.bad_request(str(e), "messages") from None
    except RecursionError:  # nested past the parser's stack
        raise E.bad_request(f"messages[{i}].tool_calls: arguments of {call.id!r} nest too deeply",
                            "messages") from None
    except ValueError:
        # Clients echo truncated calls back verbatim: the template gets the
        # text as it was (OpenAI accepts these too).
        args = call.function.arguments
    seen.add(call.id)
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": args}}
