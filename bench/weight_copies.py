#!/usr/bin/env python3
"""What a second copy of the linears' weights buys: decode speed and resident
memory with the engine's copies against one copy per linear.

A layer's linears (conveyor/parallel/layers.py) keep the parameter only, up to
4 fp32 rows (the plain kernel) and above 64 (oneDNN over the parameter); a
step of 5-64 fp32 rows packs a second copy for the packed kernel, unless the
engine's decode steps fit the plain kernel (max_num_seqs <= 4): then those
rows run oneDNN over the parameter too.
``--policy one`` runs those rows on oneDNN over the parameter instead (no
second copy), so the pair of runs shows the speed that copy buys per batch
size and the memory it costs. bf16 keeps oneDNN's packed copy either way.

Each (model, dtype, batch, policy) runs in a fresh process: an LLM with
max_num_seqs = batch, a warm-up, then ``batch`` greedy sequences of
``--prompt-len`` prompt tokens and ``--decode-tokens`` output tokens (ignore_eos);
decode tok/s = batch * (N - 1) / (T(N tokens) - T(1 token)). Reported: that,
the process's VmRSS and VmHWM after the run, and the bytes of the model's
weights (parameter count times the dtype's size). Tokens of the two policies are compared (fp32: the kernels sum in
different orders, so a divergence late in a sequence can be rounding).

``--vllm``: also vLLM's CPU build (the peer venv, bench/peers/vllm_offline_peer.py)
on the same checkpoint, dtype and batch (``batch`` prompts, max_num_seqs = batch,
a ``--vllm-kv-gib`` KV cache), for the resident memory of its process tree
(the front process and its engine core) beside ours.

Usage:
  flock /tmp/conveyor_heavy.lock .venv/bin/python bench/weight_copies.py
  .venv/bin/python bench/weight_copies.py --models 0.5b --dtypes float32 --batches 1,16
  .venv/bin/python bench/weight_copies.py --batches 1 --vllm
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import PEERS, peer_env, peer_python  # noqa: E402
from bench.lib.meta import emit_report, hardware_info, run_meta  # noqa: E402
from bench.lib.models import OUT, param_count  # noqa: E402
from bench.lib.models import model_dir as bench_model_dir  # noqa: E402
from bench.lib.prompts import make_prompts  # noqa: E402


def run_inline(job: dict) -> dict:
    """One (model, dtype, batch, policy) in this process."""
    import torch

    torch.set_num_threads(job["threads"])
    from conveyor.kernels import cpu_linear

    if job["policy"] == "one":
        cpu_linear.SMALL_ROWS_F32 = cpu_linear.PLAIN_ROWS  # 5+ fp32 rows on oneDNN over the parameter
    from conveyor.engine import LLM, SamplingParams

    b, n = job["batch"], job["decode_tokens"]
    prompts = make_prompts(b + 1, seed=7, vocab=job["vocab"], lo=job["prompt_len"], hi=job["prompt_len"] + 1)
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], max_num_seqs=b, enable_prefix_caching=False,
              max_model_len=job["prompt_len"] + n + 8)

    def gen(k: int) -> tuple[list[list[int]], float]:
        sp = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate(prompts[:b], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out], time.perf_counter() - t0

    llm.generate([prompts[b]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    gen(n)  # warm: every row count of the run, and the packed copies it makes
    t1 = min(gen(1)[1] for _ in range(2))
    tokens, tn = gen(n)
    tn = min(tn, gen(n)[1])
    llm.shutdown()
    rss = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                rss[line.split(":")[0]] = round(int(line.split()[1]) / 1024, 1)
    return {"decode_tok_s": round(b * (n - 1) / (tn - t1), 2), "rss_mib": rss.get("VmRSS", 0.0),
            "peak_rss_mib": rss.get("VmHWM", 0.0), "tokens": tokens}


def run_fresh(job: dict) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_job", json.dumps(job)],
                          capture_output=True, text=True, cwd=REPO)
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def run_vllm(model_dir: str, dtype: str, batch: int, args: argparse.Namespace) -> dict:
    """vLLM's CPU build on the same work: its tok/s and tree RSS."""
    cmd = [peer_python(), os.path.join(PEERS, "vllm_offline_peer.py"), model_dir, "--dtype", dtype,
           "--num-prompts", str(batch), "--max-num-seqs", str(batch), "--output-len", str(args.decode_tokens),
           "--prompt-len-range", f"{args.prompt_len},{args.prompt_len + 1}", "--repeats", "1",
           "--kv-cache-gib", str(args.vllm_kv_gib), "--max-model-len", str(args.prompt_len + args.decode_tokens + 8)]
    env = {**os.environ, **peer_env(bind=f"0-{args.threads - 1}", quiet=True)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            out = json.loads(line)
            return {"tree_rss_mib": out["tree_rss_mib"], "kv_cache_gib": args.vllm_kv_gib}
    raise RuntimeError(f"vLLM run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b,1b", help="names of bench/lib/models.py's SPECS")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--vllm", action="store_true", help="also vLLM's CPU build, for its resident memory")
    ap.add_argument("--vllm-kv-gib", type=float, default=0.25)
    ap.add_argument("--json", default=os.path.join(OUT, "weight_copies.json"))
    ap.add_argument("--_job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._job:
        print(json.dumps(run_inline(json.loads(args._job))), flush=True)
        return
    rows = []
    for name in args.models.split(","):
        path = bench_model_dir(name)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        vocab = config["vocab_size"]
        for dtype in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                res = {}
                for policy in ("engine", "one"):
                    job = {"model_dir": path, "dtype": dtype, "batch": batch, "policy": policy, "vocab": vocab,
                           "threads": args.threads, "prompt_len": args.prompt_len,
                           "decode_tokens": args.decode_tokens}
                    res[policy] = run_fresh(job)
                same = res["engine"].pop("tokens") == res["one"].pop("tokens")
                weights = param_count(config) * (4 if dtype == "float32" else 2) / 2**20
                row = {"model": name, "dtype": dtype, "batch": batch, "weights_mib": round(weights), **res,
                       "speedup_of_second_copy": round(res["engine"]["decode_tok_s"] / res["one"]["decode_tok_s"], 3),
                       "tokens_identical": same}
                rows.append(row)
                if args.vllm:
                    row["vllm"] = run_vllm(path, dtype, batch, args)
                e, o = res["engine"], res["one"]
                print(f"{name} {dtype} batch {batch}: decode {e['decode_tok_s']} vs {o['decode_tok_s']} tok/s "
                      f"({row['speedup_of_second_copy']}x), RSS {e['rss_mib']:.0f} vs {o['rss_mib']:.0f} MiB, "
                      f"weights {weights:.0f} MiB, tokens identical: {same}"
                      + (f", vLLM tree RSS {row['vllm']['tree_rss_mib']:.0f} MiB" if args.vllm else ""), flush=True)
    emit_report({"meta": run_meta(hardware=hardware_info()), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
