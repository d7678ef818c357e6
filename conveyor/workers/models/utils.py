"""Pipeline-parallel helpers shared by the model families."""
from __future__ import annotations

from collections.abc import Callable

from torch import nn


class PPMissingLayer(nn.Identity):
    """Stands in for a module owned by another PP stage: no parameters, and
    the weight loader skips checkpoint tensors under its name."""


def get_pp_layer_range(num_layers: int, pp_rank: int, pp_size: int,
                       override: list[int] | None = None) -> tuple[int, int]:
    """[start, end) of the decoder layers held by PP stage `pp_rank`.

    Even split; the `num_layers % pp_size` leftover layers go one each to the
    LAST stages (stage 0 also embeds the tokens, so it is never the longest).
    `override` gives the layer count of every stage explicitly.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is outside pp_size {pp_size}")
    if override is not None:
        if len(override) != pp_size or sum(override) != num_layers or min(override) < 1:
            raise ValueError(
                f"layer partition {override} must have {pp_size} entries, each >= 1, "
                f"summing to num_layers {num_layers}")
        counts = list(override)
    else:
        if pp_size > num_layers:
            raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's "
                             f"num_hidden_layers {num_layers}")
        base, rem = divmod(num_layers, pp_size)
        counts = [base + (1 if i >= pp_size - rem else 0) for i in range(pp_size)]
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def make_layers(num_layers: int, start: int, end: int,
                factory: Callable[[int], nn.Module]) -> nn.ModuleList:
    """All `num_layers` slots, so checkpoint indices match; only [start, end) are real."""
    return nn.ModuleList(factory(i) if start <= i < end else PPMissingLayer()
                         for i in range(num_layers))
