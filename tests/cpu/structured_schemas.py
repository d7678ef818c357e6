"""JSON schemas for the structured-output tests: every language is finite
(strings, arrays and numbers bounded), so a constrained output must finish."""
from __future__ import annotations

S = {"type": "string", "maxLength": 6}
I = {"type": "integer", "minimum": -50, "maximum": 50}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"a": I}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "null"}}, "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"enum": [1, 2, 3, "four", None, True]}}, "required": ["n"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"pt": {"type": "array", "items": I, "minItems": 2, "maxItems": 2}},
     "required": ["pt"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"deep": {
        "type": "object", "properties": {"z": I}, "required": ["z"], "additionalProperties": False}},
        "required": ["deep"], "additionalProperties": False}}, "required": ["inner"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
     "required": ["s"], "additionalProperties": False},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"],
     "additionalProperties": False},
    {"type": "object", "properties": {"u": {"type": "string", "format": "uuid"}}, "required": ["u"],
     "additionalProperties": False},
    {"type": "object", "properties": {"t": {"type": "string", "format": "ipv4"}}, "required": ["t"],
     "additionalProperties": False},
    {"type": "object", "properties": {"k": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
     "required": ["k"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "integer", "minimum": 100, "maximum": 999}},
     "required": ["p"], "additionalProperties": False},
    {"type": "object", "properties": {"f": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}},
     "required": ["f"], "additionalProperties": False},
    {"type": "object", "properties": {"g": {"type": "number", "minimum": -5.5, "maximum": 5.5, "multipleOf": 0.5}},
     "required": ["g"], "additionalProperties": False},
    {"type": "object", "properties": {"req": I, "opt": S}, "required": ["req"], "additionalProperties": False},
    {"type": "object", "properties": {"a": S, "b": S, "c": S}, "required": [], "additionalProperties": False},
    {"type": "object", "properties": {"val": {"anyOf": [I, S]}}, "required": ["val"], "additionalProperties": False},
    {"type": "object", "properties": {"val": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}},
     "required": ["val"], "additionalProperties": False},
    {"type": "object", "properties": {"pet": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["kind", "lives"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"], "additionalProperties": False}]}}, "required": ["pet"],
     "additionalProperties": False},
    {"$defs": {"P": {"type": "object", "properties": {"x": I, "y": I}, "required": ["x", "y"],
                     "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/P"}, "b": {"$ref": "#/$defs/P"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"$defs": {"Item": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                        "label": S}, "required": ["id", "label"],
                        "additionalProperties": False}},
     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"},
                                               "maxItems": 2}}, "required": ["items"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    {"type": "string", "maxLength": 8},
    {"type": "integer", "minimum": 0, "maximum": 1000},
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2},
                                            "maxItems": 2}}, "required": ["m"], "additionalProperties": False},
    {"type": "object", "properties": {"e": {"type": "string", "format": "email", "maxLength": 20}},
     "required": ["e"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                                      "n": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["id", "n"], "additionalProperties": False},
]

REGEXES = [r"[a-c]{2,4}-[0-9]{2}", r"(yes|no)", r"[0-9]{3}-[0-9]{4}", r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5})?"]
CHOICES = [["yes", "no", "maybe"], ["red", "green", "blue", "cyan"], ["日本", "中国"]]
LARK = """
start: expr
expr: term (("+" | "-") term){0,3}
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
