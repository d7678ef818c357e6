"""Conveyor: a vLLM-V1-style LLM inference cluster on Ray.

The public face is `from conveyor import LLM, SamplingParams, LoRARequest`: the names
of `conveyor.engine.__all__`, re-exported on first use, so `import conveyor` and
`import conveyor.engine.core.scheduler` load neither torch nor Ray."""
from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    # Not at import time: a copy of one subpackage (conveyor/kernels alone) imports without engine/.
    engine = importlib.import_module("conveyor.engine")
    if name == "__all__":  # `from conveyor import *`
        return list(engine.__all__)
    if name not in engine.__all__:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    return getattr(engine, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(importlib.import_module("conveyor.engine").__all__))
