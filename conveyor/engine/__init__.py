"""Conveyor's engine core. `import conveyor.engine.scheduler` loads no torch: the LLM
class (which reaches the executors and workers) is exposed lazily."""
from __future__ import annotations

from typing import Any

from conveyor.engine.lora import LoRARequest
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured_output.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "LoRARequest", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from conveyor.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'conveyor.engine' has no attribute {name!r}")
