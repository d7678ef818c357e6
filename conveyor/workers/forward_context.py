"""Per-step context read by Attention layers during one forward pass.

The model runner enters `set_forward_context` around each forward; layers call
`get_forward_context()` instead of threading metadata through every signature.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    # conveyor.kernels.backends.AttentionMetadata, or None for a plain causal forward
    # with no paged cache (profiling, tests).
    attn_metadata: Any
    # conveyor.kernels.backends.AttentionBackend used by every Attention layer this step.
    attn_backend: Any
    # The KV connector's worker side when it is layerwise (its per-layer hooks), else None.
    kv_connector: Any = None


_CTX: ForwardContext | None = None


def get_forward_context() -> ForwardContext | None:
    return _CTX


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any, attn_backend: Any, kv_connector: Any = None) -> Iterator[None]:
    global _CTX
    prev, _CTX = _CTX, ForwardContext(attn_metadata, attn_backend, kv_connector)
    try:
        yield
    finally:
        _CTX = prev
