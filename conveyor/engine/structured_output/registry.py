"""The grammar-backend registry: name -> factory. Built-in backends are
imported on first use (llguidance is a large native module); a third-party
backend registers its factory with register_backend. The built-in names are
the config's GRAMMAR_BACKENDS (conveyor/engine/config/sections.py owns the list)."""
from __future__ import annotations

from typing import Any

from conveyor.engine.config.sections import GRAMMAR_BACKENDS
from conveyor.engine.structured_output.backend import BackendFactory, StructuredOutputBackend

_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    _BACKENDS[name] = factory


def _builtin(name: str) -> BackendFactory | None:
    if name == "llguidance":
        from conveyor.engine.structured_output.llguidance_backend import make_llguidance_backend

        return make_llguidance_backend
    return None


def backend_names() -> list[str]:
    return sorted({*GRAMMAR_BACKENDS, *_BACKENDS})


def make_backend(name: str, tokenizer_dir: str, vocab_size: int, eos_token_id: int | None,
                 allow_additional_properties: bool = False) -> StructuredOutputBackend[Any]:
    """tokenizer_dir holds tokenizer.json; vocab_size is the model's (logits) width;
    allow_additional_properties: JSON Schema's open default for objects that
    declare properties (False: closed, conveyor/engine/structured_output/schema.py)."""
    factory = _BACKENDS.get(name) or _builtin(name)
    if factory is None:
        raise ValueError(f"unknown structured-output backend {name!r}; known: {backend_names()}")
    return factory(tokenizer_dir, vocab_size, eos_token_id, allow_additional_properties)
