"""CPU paged attention: C++ kernels for decode and for fp32/bf16 prefill.

Decode rows and speculative drafts (query_len <= _SHORT_QUERY) go to
``csrc/paged_attention_cpu.cpp``, which reads K/V in place through the block
table (the torch backend gathers a padded copy and masks it every step: about
half the decode step on CPU). Longer prefill chunks in fp32 or bf16 take the
vector tables' own flash-style kernel (``csrc/simd_prefill.inc``: queries along
the lanes, K/V read in place, 1.5-2.3x ATen's flash SDPA on AVX-512, about even
on AVX2); fp16 and the portable table stay on the torch backend's SDPA path. ``torch_attention.paged_attention_ref`` is the reference all are tested against.

The kernels come in three tables, all in one build and chosen by cpuid at
load: ``avx512`` (fp32 decode attention at head size 32/64/128 in AVX-512
intrinsics: decode attention is bound by reading K/V from memory, and with
every layer's cache past L3 the portable loop read 7.5 GB/s of one core's 29,
this path 15-16; bench/cpu_attention.py; a few long decode rows are split
along their keys over the threads, ``split_part_len``), ``avx2`` (the same kernel 8 floats
wide, same exp polynomial and masked tails: AVX2-only x86 such as older EPYC
and Xeon) and ``portable`` (plain C++ loops, any CPU). The build has no
``-march``: each ISA file raises its own target (``#pragma GCC target``), so an
extension built on one machine runs on another. ``model.cpu_isa``
(``CONVEYOR_CPU_ISA``) or ``select_isa`` forces one table. The same extension
holds the model's CPU-native ops: fused residual + RMSNorm, in-place neox
rotary and the fused SiLU-and-mul of the gate_up output (AVX-512/AVX2 in the
vector tables). bf16/fp16 caches take the same vector attention kernels, rows
widened to fp32 in registers (the AVX2 table needs F16C, which every AVX2 CPU has). Everything is compiled with
``-ffp-contract=off``: no product is fused into an FMA behind the source's back,
so the rotary rounds exactly as its torch form on every table.

The extension is compiled on first use with ``torch.utils.cpp_extension``
(gcc + ninja; about 30 s once, then cached under ``TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``, in a directory named by the hash of the sources,
headers, flags and torch version: two checkouts with different kernels never
rebuild over each other, and a process loading one never waits on the other's
build lock). A process finding a finished build there imports it directly,
so a copy of the tree at another path loads the same build instead of
rebuilding it. ``available()`` says whether that worked.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import threading
import time
from types import ModuleType

import numpy as np
import torch

from .metadata import AttentionMetadata
from .torch_attention import _SHORT_QUERY, _prefill_one, write_kv_torch

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# The glue and one file per kernel table. No -march: each ISA file raises its
# own target, so a build made on one machine runs on any other x86-64 (or,
# portable table only, any other CPU gcc builds for).
_SOURCES = [os.path.join(_CSRC, f) for f in
            ("paged_attention_cpu.cpp", "kernels_portable.cpp", "kernels_avx2.cpp", "kernels_avx512.cpp",
             # multi-LoRA (conveyor/kernels/lora_cpu.py): its op registers with torch's dispatcher
             "lora_cpu.cpp", "lora_portable.cpp", "lora_avx2.cpp", "lora_avx512.cpp",
             # small-M linears (conveyor/kernels/cpu_linear.py): its op registers with torch's dispatcher
             "linear_cpu.cpp", "linear_portable.cpp", "linear_avx2.cpp", "linear_avx512.cpp",
             # a MoE layer's experts in one op over the small-M linear tables (conveyor/kernels/cpu_moe.py)
             "moe_cpu.cpp", "moe_amx.cpp",
             # a DecodeStack step in one call (conveyor/workers/models/decode_stack.py)
             "decode_layers.cpp")]
# Headers the sources include: hashed into the build directory's name.
_HEADERS = ("cpu_kernels.h", "generic_kernels.inc", "simd_kernels.inc", "simd_prefill.inc", "lora_kernels.h",
            "lora_simd.inc", "linear_kernels.h", "linear_simd.inc", "linear_plain.inc", "linear_tables.h", "bf16_avx512.inc", "cpu_ops.h",
            "i8_gemm_avx512.inc")
ISAS = ("auto", "avx512", "avx2", "portable")
_EXT_NAME = "conveyor_paged_attention_cpu"
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_BUILT_MARKER = "built"  # written once a build in that directory has loaded
_lock = threading.Lock()
_ext: ModuleType | None = None
_error: str | None = None


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH: make that the pip package's
    binary whenever it is installed, also ahead of a system ninja. Two ninja
    versions (here 1.11 in /usr/bin, 1.13 from pip) each read the other's
    .ninja_log as invalid and rebuild the kernel, about 30 s, whenever a
    process with the other one loads it: a driver without the venv's bin on
    PATH and Ray workers with it did so on every test run."""
    try:
        import ninja
    except ImportError:
        return
    pip_ninja = os.path.join(ninja.BIN_DIR, "ninja")
    found = shutil.which("ninja")
    if not os.path.exists(pip_ninja) or (found and os.path.samefile(found, pip_ninja)):
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load_extension() -> ModuleType:
    """Build (once per source/flags) and import the C++ kernel; raises RuntimeError on failure."""
    global _ext, _error
    with _lock:
        if _ext is not None:
            return _ext
        if _error is not None:
            raise RuntimeError(_error)
        t0 = time.perf_counter()
        try:
            build_dir = _build_directory(_CFLAGS)
            _ext = _import_built(build_dir) or _build_and_import(build_dir)
        except Exception as e:  # compiler missing, headers missing, ...
            _error = f"the CPU attention kernel did not build: {type(e).__name__}: {e}"
            raise RuntimeError(_error) from e
        logger.info("CPU attention kernel ready in %.1f s", time.perf_counter() - t0)
        return _ext


def _import_built(build_dir: str) -> ModuleType | None:
    """The extension built earlier from these very sources, headers and flags
    (the directory is named by their hash), imported without asking torch's
    builder, or None when no build finished there. torch's builder writes the
    sources' absolute paths into its build.ninja, so a copy of this tree at
    another path (a `ray job submit --working-dir` package, a second clone)
    would rebuild identical code, about a minute of CPU, and the next process
    of the first tree would rebuild it back."""
    import importlib.util

    library = os.path.join(build_dir, f"{_EXT_NAME}.so")
    if not (os.path.exists(os.path.join(build_dir, _BUILT_MARKER)) and os.path.exists(library)):
        return None
    spec = importlib.util.spec_from_file_location(_EXT_NAME, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_and_import(build_dir: str) -> ModuleType:
    """Build with torch's builder (under its lock in the build directory),
    then mark the directory done: the marker is written only after the
    library loaded, so `_import_built` never opens a half-linked file."""
    _put_ninja_on_path()
    from torch.utils.cpp_extension import load

    module = load(name=_EXT_NAME, sources=_SOURCES, extra_include_paths=[_CSRC], extra_cflags=_CFLAGS,
                  extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=False)
    tmp = os.path.join(build_dir, f"{_BUILT_MARKER}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{_EXT_NAME}.so built from {_CSRC}\n")
    os.replace(tmp, os.path.join(build_dir, _BUILT_MARKER))
    return module


def _build_directory(cflags: list[str]) -> str:
    """Where this exact kernel is built: the root torch would use, then one
    directory per content hash of sources, headers, flags and torch version."""
    import hashlib

    h = hashlib.sha1(" ".join(cflags + [torch.__version__]).encode())
    for path in _SOURCES + [os.path.join(_CSRC, name) for name in _HEADERS]:
        with open(path, "rb") as f:
            h.update(f.read())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")
    path = os.path.join(root, f"{_EXT_NAME}-{h.hexdigest()[:16]}")
    os.makedirs(path, exist_ok=True)
    return path


def isa() -> str:
    """The kernel table in use: ``avx512``, ``avx2`` or ``portable``."""
    return load_extension().isa()


def supported_isas() -> list[str]:
    """The kernel tables this CPU runs, best first (cpuid at load)."""
    return list(load_extension().supported_isas())


def select_isa(name: str) -> str:
    """Use kernel table ``name`` (``auto``: the best this CPU runs) for every
    later call in this process; returns the one in use. ValueError for a name
    this CPU cannot run, naming the ones it can."""
    if name not in ISAS:
        raise ValueError(f"unknown kernel ISA {name!r}; choose one of {', '.join(ISAS)}")
    ext = load_extension()
    if name != "auto" and name not in ext.supported_isas():
        raise ValueError(f"kernel ISA {name!r} is not supported on this CPU; it runs "
                         f"{', '.join(ext.supported_isas())} (model.cpu_isa / CONVEYOR_CPU_ISA)")
    ext.set_isa(name)
    return ext.isa()


def available() -> bool:
    try:
        load_extension()
    except RuntimeError:
        return False
    return True


def loaded() -> ModuleType | None:
    """The extension if the cpu backend has loaded it, else None: the model's
    CPU-native ops (RMSNorm) follow the backend choice, so a run on the torch
    backend stays pure torch (the reference)."""
    return _ext


def build_error() -> str | None:
    return _error


def _as_long(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))


# Split-KV (paged_attention_short's part_len): a decode row's keys are cut
# into slices of at least this many positions, and only when the step's
# kernel rows hold fewer than _SPLIT_TASKS_PER_THREAD slices' worth per thread.
_SPLIT_MIN_KEYS = 256
_SPLIT_TASKS_PER_THREAD = 2


def split_part_len(seq_lens: np.ndarray, threads: int) -> int:
    """Keys per split-KV slice for these kernel rows on ``threads`` threads
    (0: no split). Batch 1 at 8k on 2 threads: 4 slices of 2048; batch 64 at
    256: none (the requests alone keep every thread busy)."""
    if threads <= 1 or seq_lens.size == 0:
        return 0
    return max(_SPLIT_MIN_KEYS, -(-int(seq_lens.sum()) // (threads * _SPLIT_TASKS_PER_THREAD)))


def step_plan(meta: AttentionMetadata) -> _StepPlan:
    """The step's kernel plan, built at its first layer and kept on the
    metadata: every layer of the step shares it."""
    plan = meta.__dict__.get("_cpu_plan")
    if plan is None:
        plan = meta.__dict__["_cpu_plan"] = _StepPlan(meta.block_table, meta.query_start_loc_cpu, meta.seq_lens_cpu)
    return plan


class _StepPlan:
    """The per-step split into kernel rows and prefill rows, with the kernel's
    index tensors: every layer of a step shares it (built once per metadata)."""

    def __init__(self, block_table: torch.Tensor, query_start_loc_cpu: np.ndarray,
                 seq_lens_cpu: np.ndarray, part_len: int | None = None) -> None:
        qsl = np.asarray(query_start_loc_cpu, dtype=np.int64)
        lens = np.asarray(seq_lens_cpu, dtype=np.int64)
        self.table = (block_table if block_table.dtype == torch.int32 else block_table.int()).contiguous()
        self.long: list[tuple[int, int, int, int]] = []
        self.short: tuple[torch.Tensor, ...]
        q_lens = qsl[1:] - qsl[:-1]
        if bool((q_lens == 1).all()):  # a decode step: every row short, no index to gather
            rows = torch.arange(len(lens))
            self.short = (rows, rows, torch.ones(len(lens), dtype=torch.int64), torch.from_numpy(lens))
            short_lens = lens
        else:
            short = np.nonzero((q_lens >= 1) & (q_lens <= _SHORT_QUERY))[0]
            self.short = tuple(_as_long(x) for x in (short, qsl[short], q_lens[short], lens[short]))
            short_lens = lens[short]
            self.long = [(int(r), int(qsl[r]), int(q_lens[r]), int(lens[r]))
                         for r in np.nonzero(q_lens > _SHORT_QUERY)[0]]
        self.num_short = len(short_lens)
        self.part_len = (split_part_len(short_lens, torch.get_num_threads()) if part_len is None
                         else part_len)


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc_cpu: np.ndarray,
    seq_lens_cpu: np.ndarray,
    scale: float,
    plan: _StepPlan | None = None,
    part_len: int | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_attention_torch``: ``[T, Hq, D]``, padding rows zero.
    ``part_len`` overrides the split-KV slice length (0: no split; tests)."""
    ext = load_extension()
    plan = plan or _StepPlan(block_table, query_start_loc_cpu, seq_lens_cpu, part_len)
    # Every row a request owns is written below; only batch padding is zeroed.
    out = torch.empty(query.shape, dtype=query.dtype)
    out[int(query_start_loc_cpu[-1]):].zero_()
    q = query.contiguous()  # the kernels write out with the query's strides
    if plan.num_short:
        ext.paged_attention_short(q, kv_cache, plan.table, *plan.short, float(scale), out, plan.part_len)
    for r, start, q_len, seq_len in plan.long:  # fp32/bf16 on a vector table: own kernel, else SDPA
        if not ext.paged_prefill(q, kv_cache, plan.table[r], start, q_len, seq_len, float(scale), out):
            _prefill_one(query, kv_cache, block_table[r], start, q_len, seq_len, scale, out)
    return out


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of unmapping it: every
    activation past 128 KB (a 2048-token prefill's are 4-23 MB) was a fresh
    mmap, page-faulted in on first touch and munmapped when freed, per op per
    layer. Allocations up to 1 GiB now come from the heap and the heap is
    never trimmed, so the process holds its peak (vLLM's CPU build gets the
    same from tcmalloc, which it preloads). 2048-token prefill of the 30M
    Llama: 0.54 -> 0.47 s. Returns False where libc has no mallopt (musl, macOS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
        return bool(libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1 and ok)
    except (OSError, AttributeError):
        return False


def release_freed_memory() -> bool:
    """Return the heap's free memory to the OS once (glibc's malloc_trim),
    after a load step freed large tensors that keep_freed_memory would hold
    for the process's life: int8 quantization drops the fp32 weights (0.5B:
    RSS 2861 MiB against 2231 for fp32 before this). False without glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


class CpuAttentionBackend:
    """The CPU default when the kernel builds (see ``get_attention_backend``);
    building it also applies ``keep_freed_memory`` to the process."""

    name = "cpu"

    def __init__(self, cpu_isa: str = "auto") -> None:
        load_extension()
        keep_freed_memory()
        self.isa = select_isa(cpu_isa)
        logger.info("CPU kernels: %s (this CPU runs %s)", self.isa, ", ".join(supported_isas()))

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        d = kv_cache.shape[4]
        native = (key.dtype == value.dtype == kv_cache.dtype and slot_mapping.dtype == torch.int64
                  and key.stride()[1:] == (d, 1) and value.stride()[1:] == (d, 1))
        if not native:
            write_kv_torch(key, value, kv_cache, slot_mapping)
            return
        assert _ext is not None  # loaded in __init__
        _ext.write_kv(key, value, kv_cache, slot_mapping.contiguous())

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention_cpu(query, kv_cache, meta.block_table, meta.query_start_loc_cpu,
                                   meta.seq_lens_cpu, scale, step_plan(meta))
