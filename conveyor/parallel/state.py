"""Process-group state for tensor (TP) and pipeline (PP) parallelism.

Rank layout: ``rank = pp_rank * tp_size + tp_rank`` — the ranks of one TP group
are consecutive, so a placement that packs consecutive ranks onto one node keeps
every TP group (the chatty one) on one node.

When `init_distributed` was never called, every helper answers as a world of
size 1 (tp_size() == pp_size() == 1, rank 0, first and last PP stage) and the
collectives are no-ops, so single-process code and unit tests need no setup.

This module imports only torch and the standard library.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass
class ParallelState:
    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    backend: str
    tp_group: ProcessGroup
    pp_group: ProcessGroup
    # gloo groups with the same members, for small CPU-side metadata; they are
    # the device groups themselves when the device backend is gloo.
    tp_cpu_group: ProcessGroup
    pp_cpu_group: ProcessGroup
    # Global ranks of this rank's PP group, indexed by pp_rank.
    pp_ranks: list[int]
    # gloo over every rank (the default group when the backend is gloo), for
    # what all ranks must agree on each step (KV tier transfers).
    world_cpu_group: ProcessGroup | None = None


_STATE: ParallelState | None = None


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact integer division; uneven splits are configuration errors."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(
            f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _check_sizes(world_size: int, rank: int, tp_size: int, pp_size: int) -> None:
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tp_size ({tp_size}) and pp_size ({pp_size}) must be >= 1")
    if world_size != tp_size * pp_size:
        raise ValueError(
            f"world_size ({world_size}) != tp_size ({tp_size}) * pp_size ({pp_size})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")


def _new_groups(rank_lists: list[list[int]], rank: int, backend: str,
                timeout: datetime.timedelta) -> tuple[ProcessGroup, ProcessGroup]:
    """Create one device group (+ gloo twin) per rank list; return this rank's.

    new_group is collective over the whole world: every rank must call it for
    every group, in the same order, even for groups it is not a member of.
    """
    mine: tuple[ProcessGroup, ProcessGroup] | None = None
    for ranks in rank_lists:
        dev = dist.new_group(ranks, backend=backend, timeout=timeout)
        cpu = dev if backend == "gloo" else dist.new_group(
            ranks, backend="gloo", timeout=timeout)
        if rank in ranks:
            mine = (dev, cpu)
    assert mine is not None, "every rank belongs to exactly one group"
    return mine


def init_distributed(world_size: int, rank: int, tp_size: int, pp_size: int,
                     init_method: str, backend: str | None = None,
                     timeout_s: float = 60) -> ParallelState:
    """Join the world and build the TP and PP groups. Call once per process."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError("init_distributed was already called in this process")
    _check_sizes(world_size, rank, tp_size, pp_size)
    backend = backend or default_backend()
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method,
                                world_size=world_size, rank=rank, timeout=timeout)
    tp_lists = [[p * tp_size + t for t in range(tp_size)] for p in range(pp_size)]
    pp_lists = [[p * tp_size + t for p in range(pp_size)] for t in range(tp_size)]
    tp_group, tp_cpu = _new_groups(tp_lists, rank, backend, timeout)
    pp_group, pp_cpu = _new_groups(pp_lists, rank, backend, timeout)
    world_cpu = dist.group.WORLD if backend == "gloo" else dist.new_group(
        list(range(world_size)), backend="gloo", timeout=timeout)
    _STATE = ParallelState(
        world_size=world_size, rank=rank, tp_size=tp_size, pp_size=pp_size,
        tp_rank=rank % tp_size, pp_rank=rank // tp_size, backend=backend,
        tp_group=tp_group, pp_group=pp_group, tp_cpu_group=tp_cpu,
        pp_cpu_group=pp_cpu, pp_ranks=pp_lists[rank % tp_size], world_cpu_group=world_cpu)
    return _STATE


def destroy_distributed() -> None:
    """Tear down all groups; afterwards everything answers as world size 1."""
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return _STATE is not None


def _require() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("parallel state is not initialised (init_distributed)")
    return _STATE


def world_size() -> int:
    return 1 if _STATE is None else _STATE.world_size


def tp_rank() -> int:
    return 0 if _STATE is None else _STATE.tp_rank


def tp_size() -> int:
    return 1 if _STATE is None else _STATE.tp_size


def pp_rank() -> int:
    return 0 if _STATE is None else _STATE.pp_rank


def pp_size() -> int:
    return 1 if _STATE is None else _STATE.pp_size


def is_first_pp_rank() -> bool:
    return pp_rank() == 0


def is_last_pp_rank() -> bool:
    return pp_rank() == pp_size() - 1


def get_pp_group() -> ProcessGroup:
    return _require().pp_group


def get_world_cpu_group() -> ProcessGroup | None:
    return _require().world_cpu_group


def get_pp_cpu_group() -> ProcessGroup:
    return _require().pp_cpu_group


def pp_next_rank() -> int:
    """Global rank of the next PP stage with the same tp_rank (wraps around)."""
    s = _require()
    return s.pp_ranks[(s.pp_rank + 1) % s.pp_size]


def pp_prev_rank() -> int:
    """Global rank of the previous PP stage with the same tp_rank (wraps around)."""
    s = _require()
    return s.pp_ranks[(s.pp_rank - 1) % s.pp_size]


# Collectives. They consult the real state (not tp_size()), so a test that
# fakes tp_rank()/tp_size() to exercise weight slicing never reaches torch.distributed.

def _tp_active() -> bool:
    return _STATE is not None and _STATE.tp_size > 1


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group (in place on `x`); identity at tp 1."""
    if not _tp_active():
        return x
    dist.all_reduce(x, group=_STATE.tp_group)  # type: ignore[union-attr]
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim` in tp_rank order."""
    if not _tp_active():
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]  # type: ignore[union-attr]
    dist.all_gather(parts, x, group=_STATE.tp_group)  # type: ignore[union-attr]
    return torch.cat(parts, dim=dim)
