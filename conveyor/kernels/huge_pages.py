"""Host tensors on 2 MiB pages, for what a decode step streams from DRAM:
weights (parameters and packed copies) and the CPU KV cache.

Decode reads every weight once a step, far beyond the caches. On 4 KiB pages
each page is a TLB miss and the stream restarts at every page boundary; on
transparent huge pages the same small-M kernel streamed 1.15-1.2x faster
(Xeon, 2 threads, 256 MB of packed fp32 weights: 25.4 -> 30.2 GB/s at 1 row,
21.4 -> 25.8 at 12, 17.3 -> 19.9 at 16; BENCHMARKS.md, "Huge pages").

Linux gives an anonymous mapping huge pages where THP is ``always``, or
``madvise`` (the common default) and the range is advised; this module maps
each large tensor on its own 2 MiB-aligned range and advises it. Where THP is
``never``, off Linux, or with ``CONVEYOR_HUGE_PAGES=0`` in the environment,
the tensor is an ordinary one: the same bits, only slower. The mapping lives
as long as any tensor viewing it.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20
# Tensors smaller than this stay on torch's allocator: a page of their own
# would waste most of it, and small tensors stay in cache anyway.
MIN_BYTES = HUGE_PAGE


def _advisable() -> bool:
    """Huge pages may be asked for: Linux, and not turned off with
    CONVEYOR_HUGE_PAGES=0 (read at each allocation, so tests can compare)."""
    return (os.environ.get("CONVEYOR_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")
            and hasattr(mmap, "MAP_ANONYMOUS"))


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised (in fact zeroed) CPU tensor, on advised 2 MiB pages
    when it is at least MIN_BYTES and the platform allows; else torch.empty."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not _advisable():
        return torch.empty(tuple(shape), dtype=dtype)
    # One page of slack to align the start: the kernel backs only aligned
    # 2 MiB ranges with huge pages. Untouched slack costs no memory.
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out: ordinary pages
        pass
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    offset = (-base) % HUGE_PAGE
    # frombuffer holds a reference to the mapping; views of the tensor keep it.
    flat = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(tuple(shape))


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """``empty``, zero-filled (a fresh mapping is zeros already; the fill
    also faults the pages in now, not in the first step)."""
    return empty(shape, dtype).zero_()


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` on huge pages (``t`` itself when
    it is small or not on the CPU)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES:
        return t
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def anon_huge_kib() -> int:
    """This process's memory on anonymous huge pages, KiB (0 off Linux)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
