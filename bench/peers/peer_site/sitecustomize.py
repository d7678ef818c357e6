"""Python runs this at start-up in every process of the vLLM peer that has
this directory on PYTHONPATH (bench/serve_compare.py and bench/compare_vllm.py
--isa avx2 put it there, bench/lib/launch.py's PEER_AVX2_ENV,
for `vllm serve`, whose engine core is a child process; a monkeypatch in the
parent alone would not reach it).

With PEER_FORCE_AVX2=1, torch reports no AVX-512, AVX512_BF16 or AMX, so
vLLM's CPU platform loads its AVX2 build (``_C_AVX2``) and vec attention, as
on an AVX2-only CPU; oneDNN and ATen are held to AVX2 by DNNL_MAX_CPU_ISA /
ATEN_CPU_CAPABILITY in the same environment.

With PEER_TORCHVISION_STUB=1, ``torchvision._meta_registrations`` is an empty
module. The registry's torchvision wheels are CUDA builds whose ops library
does not load against the CPU torch, and that module then fails at import
("operator torchvision::nms does not exist"), so vLLM could not inspect or
load a vision-language model (its llava module imports torchvision). The
stub skips only the fake-tensor registrations of torchvision's detection ops
(nms, roi_align, ...), which no VL model calls; transforms and the rest of
torchvision import as they are. bench/multimodal.py --vllm sets it.

Without either flag this file does nothing.
"""
import os


def force_avx2() -> None:
    """Make torch report no AVX-512, AVX512_BF16 or AMX."""
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False


def stub_torchvision_meta() -> None:
    """An empty torchvision._meta_registrations, imported in its place."""
    import sys
    import types

    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


if os.environ.get("PEER_FORCE_AVX2") == "1":
    force_avx2()
if os.environ.get("PEER_TORCHVISION_STUB") == "1":
    stub_torchvision_meta()
