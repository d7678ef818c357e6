"""Host tensors on advised 2 MiB pages (conveyor/kernels/huge_pages.py): the
weights, their packed copies and the CPU KV cache that decode streams."""
from __future__ import annotations

import gc

import pytest
import torch

from conveyor.kernels import huge_pages


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _advisable_or_skip() -> None:
    if not huge_pages._advisable():
        pytest.skip("no madvise(MADV_HUGEPAGE) here")


def test_a_large_tensor_gets_its_own_aligned_advised_range() -> None:
    _advisable_or_skip()
    t = huge_pages.empty((3, 1000, 700), torch.float32)  # 8.4 MB: not a page multiple
    assert t.shape == (3, 1000, 700) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in _vm_flags(t.data_ptr()), "the range is not advised for huge pages"
    assert not t.any()  # a fresh mapping reads as zeros
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()


def test_a_small_tensor_stays_on_torchs_allocator() -> None:
    t = huge_pages.empty((4, 100), torch.float32)
    assert t.shape == (4, 100) and t.dtype == torch.float32
    assert t.untyped_storage().nbytes() == 1600  # no mapping of its own


def test_the_environment_switch_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_HUGE_PAGES", "0")
    assert not huge_pages._advisable()
    t = huge_pages.empty((2, 1 << 20), torch.float32)
    assert t.untyped_storage().nbytes() == 8 << 20 and t.shape == (2, 1 << 20)


def test_views_keep_the_mapping_alive() -> None:
    _advisable_or_skip()
    t = huge_pages.empty((1 << 20,), torch.float32)
    t.copy_(torch.arange(1 << 20, dtype=torch.float32))
    part = t[10:20].view(2, 5)
    del t
    gc.collect()
    assert part.flatten().tolist() == [float(v) for v in range(10, 20)]


def test_copy_keeps_the_bits_and_dtype() -> None:
    src = torch.randn(700, 800).to(torch.bfloat16)
    out = huge_pages.copy(src)
    assert out.dtype == torch.bfloat16 and torch.equal(out.view(torch.int16), src.view(torch.int16))
    small = torch.ones(3)
    assert huge_pages.copy(small) is small


def test_packed_weights_and_parameters_land_on_huge_pages() -> None:
    """cpu_linear.pack's copy and a CPU parameter from make_param are advised
    ranges, with the same contents as before."""
    _advisable_or_skip()
    from conveyor.kernels import cpu_linear
    from conveyor.parallel.layers import make_param

    w = torch.randn(1000, 1024)
    packed = cpu_linear.pack(w)
    assert "hg" in _vm_flags(packed.data_ptr())
    assert torch.equal(cpu_linear.unpack(packed, 1000), w)
    with torch.device("cpu"):
        p = make_param((2048, 1024), torch.float32, lambda *a: None)
    assert "hg" in _vm_flags(p.data_ptr()) and p.shape == (2048, 1024) and not p.requires_grad
