"""Python runs this at start-up in every process of the vLLM peer that has
this directory on PYTHONPATH (bench/serve_compare.py and bench/compare_vllm.py
--isa avx2 put it there, bench/lib/launch.py's PEER_AVX2_ENV,
for `vllm serve`, whose engine core is a child process; a monkeypatch in the
parent alone would not reach it).

With PEER_FORCE_AVX2=1, torch reports no AVX-512, AVX512_BF16 or AMX, so
vLLM's CPU platform loads its AVX2 build (``_C_AVX2``) and vec attention, as
on an AVX2-only CPU; oneDNN and ATen are held to AVX2 by DNNL_MAX_CPU_ISA /
ATEN_CPU_CAPABILITY in the same environment. Without the flag it does nothing.
"""
import os


def force_avx2() -> None:
    """Make torch report no AVX-512, AVX512_BF16 or AMX."""
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False


if os.environ.get("PEER_FORCE_AVX2") == "1":
    force_avx2()
