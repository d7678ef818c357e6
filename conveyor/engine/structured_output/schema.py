"""JSON-schema defaults the grammar applies.

Strict objects (the default, as xgrammar's strict mode, vLLM's default
backend): an object schema that declares `properties` but says nothing about
`additionalProperties` / `unevaluatedProperties` admits no undeclared keys.
JSON Schema's own default is open, which lets a weak model keep adding keys
until max_tokens; the schemas pydantic, instructor and LangChain generate omit
the field. `structured_outputs.allow_additional_properties: true` keeps the
open default.

Invariants:
- The input is never mutated (schemas may be cached or shared by callers).
- An object that declares no properties (`{"type": "object"}`) stays open: it
  declares nothing to be strict about, and closing it would admit only `{}`.
- Members of `allOf` are not closed themselves (they are merged: each closed
  member would forbid the others' keys); their sub-schemas are.
"""
from __future__ import annotations

from typing import Any

# Keywords whose value is one schema, a list of schemas, or a map name -> schema.
_ONE = ("additionalProperties", "unevaluatedProperties", "items", "contains", "not",
        "if", "then", "else", "propertyNames", "additionalItems")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any, _close: bool = True) -> Any:
    """A copy of `schema` with undeclared keys forbidden (see module doc)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _ONE:
        if k in out:
            v = out[k]
            out[k] = [close_objects(s) for s in v] if isinstance(v, list) else close_objects(v)
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [close_objects(s) for s in out[k]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(s, _close=False) for s in out["allOf"]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: close_objects(s) for name, s in out[k].items()}
    if (_close and isinstance(out.get("properties"), dict)
            and "additionalProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out
