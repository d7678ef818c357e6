"""OpenAI `response_format` and vLLM's `structured_outputs` body field ->
StructuredOutputsParams, with 400s naming the field the client sent."""
from __future__ import annotations

from typing import Any

from conveyor.cluster.openai.errors import bad_request
from conveyor.engine.structured_output.params import StructuredOutputsParams

_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def constraint_field(structured_outputs: dict[str, Any] | None) -> str:
    """The request field a constraint came from: structured_outputs wins (a
    response_format beside it may only be "text")."""
    return "structured_outputs" if structured_outputs is not None else "response_format"


def structured_outputs_of(response_format: dict[str, Any] | None,
                          structured_outputs: dict[str, Any] | None
                          ) -> StructuredOutputsParams | None:
    """The constraint, or None."""
    if response_format is not None and structured_outputs is not None:
        if response_format.get("type", "text") != "text":
            raise bad_request("response_format and structured_outputs are mutually exclusive",
                              "structured_outputs")
    if structured_outputs is not None:
        return _from_structured_outputs(structured_outputs)
    if response_format is not None:
        return _from_response_format(response_format)
    return None


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format.json_schema must be an object with a 'schema'",
                              "response_format")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON object",
                              "response_format")
        return StructuredOutputsParams(json=schema)
    raise bad_request(f"response_format.type must be one of text, json_object, json_schema; "
                      f"got {kind!r}", "response_format")


def _from_structured_outputs(so: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(so) - set(_SO_KEYS))
    if unknown:
        raise bad_request(f"structured_outputs: unsupported key(s) {unknown}; supported: "
                          f"{', '.join(_SO_KEYS)}", "structured_outputs", "unsupported_parameter")
    try:
        return StructuredOutputsParams(**{k: v for k, v in so.items() if v is not None})
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), "structured_outputs") from None
