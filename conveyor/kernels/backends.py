"""The attention backend registry: `get_attention_backend(name, device)`.
The protocol and the per-step metadata every backend meets are in
conveyor/kernels/metadata.py (re-exported here).

Nothing here imports Triton: the Triton backend module is imported only when
``get_attention_backend`` selects it, so that ``TRITON_INTERPRET`` (needed on
CPU) can be set by the caller before any kernel is defined.
"""
from __future__ import annotations

import logging
import os

import torch

from .metadata import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

__all__ = ["BACKEND_CHOICES", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]

BACKEND_CHOICES: tuple[str, ...] = ("torch", "cpu", "triton", "auto")


def _triton_usable_on(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _cpu_or_torch() -> str:
    from . import cpu_attention

    if cpu_attention.available():
        return "cpu"
    logger.warning("falling back to the torch attention backend (slower decode): %s",
                   cpu_attention.build_error())
    return "torch"


def get_attention_backend(name: str, device: torch.device | str, cpu_isa: str = "auto") -> AttentionBackend:
    """Return the backend called ``name`` for tensors on ``device``.

    ``"auto"`` is ``"triton"`` on CUDA, and elsewhere ``"cpu"`` (the C++ kernel) when it
    builds, else ``"torch"`` with a warning. ``cpu_isa`` picks the cpu backend's
    kernel table (``cpu_attention.select_isa``; ValueError where this CPU cannot run it).
    ``"triton"`` on a non-CUDA device needs ``TRITON_INTERPRET=1`` set before
    the first kernel module import (tests only: the interpreter is slow).
    """
    device = torch.device(device)
    key = name.lower().strip()
    if key not in BACKEND_CHOICES:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_CHOICES)}"
        )
    if key == "auto":
        key = "triton" if device.type == "cuda" else _cpu_or_torch()
    if key == "cpu":
        if device.type != "cpu":
            raise RuntimeError(f"the cpu attention backend runs on CPU tensors only (got {device})")
        from .cpu_attention import CpuAttentionBackend

        return CpuAttentionBackend(cpu_isa)
    if key == "torch":
        from .torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    if not _triton_usable_on(device):
        raise RuntimeError(
            f"the triton attention backend needs a CUDA device (got {device}); on CPU set "
            "TRITON_INTERPRET=1 before importing kernels, or use the 'torch' backend"
        )
    from .paged_attention import TritonAttentionBackend

    return TritonAttentionBackend()
