"""The worker side of a KV connector (the seed's contract).

The model runner calls start_load_kv with each step's metadata before the
forward (also on steps that schedule no tokens: transfers still move), the
layer hooks around each attention layer's cache use when the connector is
layerwise, wait_for_save after the forward, and get_output once per step for
the ModelRunnerOutput.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from conveyor.engine.kv_connector.metadata import KVConnectorMetadata, KVConnectorOutput


class KVConnectorWorker(ABC):
    # True: the runner puts this connector in the forward context and every
    # attention layer calls wait_for_layer_load / save_kv_layer (eager steps;
    # captured CUDA graphs run without them).
    layerwise = False

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        """Start (or do) this step's transfers; meta None: only check those in flight."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer's KV for this step is in the pool (layerwise connectors)."""
        return None  # optional hook: nothing to do by default

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        """Layer's KV of this step is written (layerwise connectors)."""
        return None  # optional hook: nothing to do by default

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the pool blocks they read."""
        return None  # optional hook: nothing to do by default

    def wait_idle(self, timeout_s: float) -> None:
        """The step computes nothing: wait up to timeout_s for transfers in
        flight (instead of the engine spinning on empty steps)."""
        return None  # optional hook: nothing to do by default

    @abstractmethod
    def get_output(self) -> KVConnectorOutput | None:
        """What finished since the last call (None: nothing)."""

    def close(self) -> None:
        """Worker shutdown: finish (or drop) what is in flight."""
        return None  # optional hook: nothing to do by default
