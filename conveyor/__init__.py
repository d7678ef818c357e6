"""Conveyor: a vLLM-V1-style LLM inference cluster on Ray.

The public face is `from conveyor import LLM, SamplingParams, LoRARequest`.
Every name is resolved on first use, so `import conveyor.engine.scheduler`
loads neither torch nor Ray."""
from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it
_EXPORTS = {
    "LLM": "conveyor.engine.llm",
    "RequestOutput": "conveyor.engine.llm",
    "CompletionOutput": "conveyor.engine.llm",
    "SamplingParams": "conveyor.engine.sampling_params",
    "LoRARequest": "conveyor.engine.lora",
    "AsyncLLM": "conveyor.engine.async_client",
    "StructuredOutputsParams": "conveyor.engine.structured_output.params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
