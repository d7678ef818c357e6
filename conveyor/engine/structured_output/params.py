"""StructuredOutputsParams: which language a request's output must belong to.

Exactly one of json / regex / choice / grammar / json_object is set. It rides
inside SamplingParams, so it crosses process boundaries with msgspec; the
grammar itself is compiled only in the engine core.
"""
from __future__ import annotations

import json as _json
from typing import Any

import msgspec

from conveyor.engine.frontend.json_limits import check_json_value

# Bounds on what a client may ask to compile; larger specs are refused at the edge.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    json: str | dict[str, Any] | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark
    json_object: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object is True:
            set_.append("json_object")
        elif self.json_object is not False:
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        if len(set_) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar, "
                             f"json_object must be set, got {set_ or 'none'}")
        kind = set_[0]
        if kind == "json" and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or string)")
        if kind == "choice":
            _check_choice(self.choice)
        if kind != "json_object":  # before spec_text: json.dumps recurses
            check_json_value(getattr(self, kind), f"structured_outputs.{kind}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if len(self.spec_text()) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} is longer than {MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    def spec_text(self) -> str:
        """The constraint as one string: the compile cache key and size bound."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else _json.dumps(self.json, sort_keys=True)
        if kind == "choice":
            return _json.dumps(self.choice)
        if kind == "json_object":
            return "{}"
        return getattr(self, kind)


def _check_choice(choice: Any) -> None:
    if not isinstance(choice, list) or not choice:
        raise ValueError("structured_outputs.choice must be a non-empty list of strings")
    if len(choice) > MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice allows at most {MAX_CHOICES} entries")
    for c in choice:
        if not isinstance(c, str) or not c:
            raise ValueError("structured_outputs.choice entries must be non-empty strings")
