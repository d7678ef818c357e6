"""Conveyor's engine core and the public names the `conveyor` package re-exports.
`import conveyor.engine.core.scheduler` loads no torch: the LLM classes (which reach the
executors and workers) are exposed lazily."""
from __future__ import annotations

import importlib
from typing import Any

from conveyor.engine.lora import LoRARequest
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured_output.params import StructuredOutputsParams

# name -> the module under conveyor.engine that defines it, imported on first use
_LAZY = {"LLM": "frontend.llm", "RequestOutput": "frontend.llm", "CompletionOutput": "frontend.llm",
         "AsyncLLM": "frontend.async_client"}

__all__ = ["SamplingParams", "LoRARequest", "StructuredOutputsParams", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"conveyor.engine.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'conveyor.engine' has no attribute {name!r}")
