#!/usr/bin/env python3
"""Offline generation throughput: our ``LLM.generate`` vs Hugging Face
``generate``, on CPU, with a random-weight ~30M-parameter Llama.

What it does:
  1. builds (once, cached under ``bench/out/llama30m``) a random fp32 Llama
     with ``transformers`` (hidden 512, 8 layers, vocab 8192, 8 query / 4 KV
     heads, intermediate 1408, max_position_embeddings 2048); no tokenizer:
     prompts are token ids;
  2. draws ``--num-prompts`` prompts of 16..256 random token ids (fixed seed);
  3. runs each side in its own subprocess, so each side's peak RSS
     (``ru_maxrss``) is its own: ours = ``LLM(model=dir).generate(...)``
     greedy, ``ignore_eos``, ``--output-len`` tokens each; HF = batches of
     ``--hf-batch-size``, left padding + attention_mask, greedy, EOS disabled
     (``eos_token_id=None``) so exactly ``--output-len`` tokens come out
     (``min_new_tokens`` is not used: it masks the EOS logit, which our
     ``ignore_eos`` does not, so the greedy tokens could differ);
  4. reports output tokens/s of each (generate() wall time only: model loading
     and a short warm-up run are excluded), the ratio ours/HF, peak RSS, and
     compares the token ids. Where a sequence differs, vLLM's top-5 rule is
     applied at the first divergence: each side's token must be in the top-5
     of HF's logits for the shared prefix (an unpadded HF forward, so no
     left-padding effect on the reduction order), and the logit gap between
     the two tokens is printed.

Results and the time breakdown of our side: BENCHMARKS.md, "Offline throughput (CPU)".
Timings on a shared 2-core machine are noisy: use --repeats (fresh process per run, sides
interleaved; best and median are reported with CPU/wall and the load average of each run).

Usage:
  .venv/bin/python bench/offline_throughput.py --repeats 3 --json bench/out/offline_throughput.json
  .venv/bin/python bench/offline_throughput.py --num-prompts 16 --output-len 16   # quick
  .venv/bin/python bench/offline_throughput.py --skip-hf --profile bench/out/ours.prof
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.models import LLAMA_30M as MODEL_SPEC  # noqa: E402
from bench.lib.models import SPECS, model_dir, param_count  # noqa: E402
from bench.lib.prompts import make_prompts  # noqa: E402

DEFAULT_MODEL_DIR = SPECS["30m"].default_dir
PAD_ID = 0


# ---------------------------------------------------------------- helpers ----

def _peak_rss_mib(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0  # Linux: KiB


def _cur_rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ------------------------------------------------------------------ sides ----

def run_ours(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """Our side in this process: generate() wall time, RSS, CPU, tokens."""
    import torch

    torch.set_num_threads(args.threads)
    from conveyor.engine import LLM, SamplingParams

    kw = {}
    if args.max_num_seqs is not None:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.cpu_kv_cache_bytes is not None:
        kw["cpu_kv_cache_bytes"] = args.cpu_kv_cache_bytes
    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, **kw)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    if not args.no_warmup:  # first-call costs (allocator, op dispatch caches)
        llm.generate([list(range(10, 42)), list(range(50, 70))],
                     SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    rss_before = _cur_rss_mib()
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    c0, l0, t0 = _cpu_s(), os.getloadavg()[0], time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    cpu_s, load1 = _cpu_s() - c0, max(l0, os.getloadavg()[0])
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    cfg = llm.config
    info = dict(max_num_seqs=cfg.scheduler.max_num_seqs,
                max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                num_kv_blocks=llm.engine.kv_info.num_blocks,
                block_size=cfg.cache.block_size)
    llm.shutdown()
    return dict(side="ours", load_s=load_s, gen_s=gen_s, tokens=tokens, rss_before_gen_mib=rss_before,
                peak_rss_mib=_peak_rss_mib(), torch_threads=torch.get_num_threads(), engine=info,
                cpu_s=cpu_s, loadavg1=load1)


def _hf_model(model_dir: str) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def run_hf(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """Hugging Face's side: batched generate() with left padding, EOS off."""
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = _hf_model(args.model_dir)
    load_s = time.perf_counter() - t0
    gen_cfg = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=None,
                   eos_token_id=None, pad_token_id=PAD_ID, use_cache=True,
                   temperature=None, top_p=None, top_k=None)
    model.generation_config.eos_token_id = None

    def batch_tensors(batch: list[list[int]]) -> tuple[Any, Any]:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids, mask

    with torch.inference_mode():
        if not args.no_warmup:
            ids, mask = batch_tensors([list(range(10, 42)), list(range(50, 70))])
            model.generate(input_ids=ids, attention_mask=mask, **{**gen_cfg, "max_new_tokens": 4})
        rss_before = _cur_rss_mib()
        tokens: list[list[int]] = []
        c0, l0, t0 = _cpu_s(), os.getloadavg()[0], time.perf_counter()
        for s in range(0, len(prompts), args.hf_batch_size):
            ids, mask = batch_tensors(prompts[s:s + args.hf_batch_size])
            out = model.generate(input_ids=ids, attention_mask=mask, **gen_cfg)
            tokens.extend(out[:, ids.shape[1]:].tolist())
        gen_s = time.perf_counter() - t0
        cpu_s, load1 = _cpu_s() - c0, max(l0, os.getloadavg()[0])
    bad = [i for i, t in enumerate(tokens) if len(t) != args.output_len]
    if bad:
        raise RuntimeError(f"HF produced != {args.output_len} tokens for prompts {bad[:5]}")
    return dict(side="hf", load_s=load_s, gen_s=gen_s, tokens=tokens, rss_before_gen_mib=rss_before,
                peak_rss_mib=_peak_rss_mib(), torch_threads=torch.get_num_threads(),
                cpu_s=cpu_s, loadavg1=load1)


def _run_side_subprocess(side: str, args: argparse.Namespace, prompts_file: str) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out_file = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--_side", side, "--_prompts", prompts_file,
           "--_result", out_file] + args._passthrough
    try:
        subprocess.run(cmd, check=True)  # same cwd: relative paths mean the same thing
        with open(out_file) as f:
            return json.load(f)
    finally:
        os.unlink(out_file)


# --------------------------------------------------------------- compare ----

def compare(model_dir: str, prompts: list[list[int]], ours: list[list[int]], hf: list[list[int]],
            threads: int) -> dict:
    """Identical count; for the rest, vLLM's top-5 rule at the first divergence."""
    import torch

    torch.set_num_threads(threads)
    diffs = [i for i, (a, b) in enumerate(zip(ours, hf)) if a != b]
    result = dict(identical=len(prompts) - len(diffs), total=len(prompts), divergences=[])
    if not diffs:
        result["top5_ok"] = True
        return result
    model = _hf_model(model_dir)
    ok = True
    with torch.inference_mode():
        for i in diffs:
            a, b = ours[i], hf[i]
            j = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
            ctx = torch.tensor([prompts[i] + a[:j]])
            logits = model(input_ids=ctx).logits[0, -1].float()
            top = logits.topk(5)
            top_ids = top.indices.tolist()
            rec = dict(prompt=i, position=j, ours=a[j], hf=b[j], top5=top_ids,
                       ours_in_top5=a[j] in top_ids, hf_in_top5=b[j] in top_ids,
                       logit_gap=float(logits[b[j]] - logits[a[j]]),
                       top1_top2_gap=float(top.values[0] - top.values[1]))
            ok = ok and rec["ours_in_top5"] and rec["hf_in_top5"]
            result["divergences"].append(rec)
    result["top5_ok"] = ok
    return result


# ------------------------------------------------------------------- main ----

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (paths made absolute; the private ones pass the side's job on)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--min-prompt-len", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="ours (default: engine default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="ours (default: engine default)")
    ap.add_argument("--cpu-kv-cache-bytes", type=int, default=None,
                    help="ours: KV cache budget (default: engine default, 1 GiB)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per side (fresh process each, sides interleaved); best and median reported")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on both sides")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed")
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="cProfile our generate() into PATH (slows our side down)")
    ap.add_argument("--in-process", action="store_true",
                    help="run both sides in this process (peak RSS is then shared)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the summary as JSON")
    ap.add_argument("--_side", choices=("ours", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--_prompts", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    # Absolute paths, so the result does not depend on where the script is run from.
    for name in ("profile", "json", "model_dir"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    raw = list(sys.argv[1:] if argv is None else argv)
    args._passthrough = [x for x in raw if not x.startswith("--_")]
    return args


def _side_main(args: argparse.Namespace) -> None:
    with open(args._prompts) as f:
        prompts = json.load(f)
    res = run_ours(args, prompts) if args._side == "ours" else run_hf(args, prompts)
    with open(args._result, "w") as f:
        json.dump(res, f)


def main(argv: list[str] | None = None) -> int:
    """Run the sides (interleaved, --repeats times), report, compare tokens."""
    args = parse_args(argv)
    if args._side:
        _side_main(args)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    model_dir("30m", args.model_dir)
    prompts = make_prompts(args.num_prompts, args.seed, MODEL_SPEC["vocab_size"],
                           args.min_prompt_len, args.max_prompt_len)
    n_prompt_tok = sum(len(p) for p in prompts)
    print(f"model: {args.model_dir} (random Llama, {param_count(MODEL_SPEC)/1e6:.1f}M params, fp32)")
    print(f"prompts: {len(prompts)} x {args.min_prompt_len}..{args.max_prompt_len} tokens "
          f"({n_prompt_tok} prompt tokens), {args.output_len} output tokens each, greedy, "
          f"torch threads {args.threads}")
    runs = _run_sides(args, prompts, n_prompt_tok)
    summary: dict = dict(num_prompts=len(prompts), prompt_tokens=n_prompt_tok,
                         output_tokens=len(prompts) * args.output_len,
                         output_len=args.output_len, hf_batch_size=args.hf_batch_size,
                         threads=args.threads, repeats=args.repeats, python=platform.python_version(),
                         torch=_version("torch"), transformers=_version("transformers"))
    results = {side: _summarize_side(side, rs, summary, args) for side, rs in runs.items()}
    if "ours" in results and "hf" in results:
        _compare_sides(args, prompts, results, summary)
    summary["parent_peak_rss_mib"] = _peak_rss_mib()
    if not args.in_process:
        summary["children_max_peak_rss_mib"] = _peak_rss_mib(resource.RUSAGE_CHILDREN)
    print(f"{'peak RSS':>14}: this process {summary['parent_peak_rss_mib']:.0f} MiB"
          + (f", largest child {summary['children_max_peak_rss_mib']:.0f} MiB"
             if not args.in_process else ""))
    if args.profile and "ours" in results:
        import pstats
        print(f"\ncProfile of our generate() -> {args.profile}")
        pstats.Stats(args.profile).sort_stats("cumulative").print_stats(25)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    ok = "compare" not in summary or summary["compare"]["top5_ok"]
    return 0 if ok else 1


def _run_sides(args: argparse.Namespace, prompts: list[list[int]], n_prompt_tok: int) -> dict[str, list[dict]]:
    """Each side --repeats times, interleaved, so slow drifts in load hit both."""
    runs: dict[str, list[dict]] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
        prompts_file = f.name
    try:
        sides = [s for s, skip in (("ours", args.skip_ours), ("hf", args.skip_hf)) if not skip]
        for rep in range(args.repeats):
            for side in sides:
                if args.in_process:
                    r = (run_ours if side == "ours" else run_hf)(args, prompts)
                else:
                    r = _run_side_subprocess(side, args, prompts_file)
                runs.setdefault(side, []).append(r)
                _print_run(side, r, rep, args, n_prompt_tok)
    finally:
        os.unlink(prompts_file)
    return runs


def _summarize_side(side: str, rs: list[dict], summary: dict, args: argparse.Namespace) -> dict:
    """Best and median of one side's runs into summary[side]; returns the best run."""
    n_out, n_prompt_tok = summary["output_tokens"], summary["prompt_tokens"]
    for r in rs[1:]:
        if r["tokens"] != rs[0]["tokens"]:
            print(f"WARNING: {side} generated different tokens in different repeats")
    best = min(rs, key=lambda r: r["gen_s"])
    med = statistics.median(r["gen_s"] for r in rs)
    summary[side] = dict(gen_s_best=best["gen_s"], gen_s_median=med, gen_s_all=[r["gen_s"] for r in rs],
                         output_tok_s=n_out / best["gen_s"], output_tok_s_median=n_out / med,
                         total_tok_s=(n_out + n_prompt_tok) / best["gen_s"], load_s=best["load_s"],
                         rss_before_gen_mib=best["rss_before_gen_mib"],
                         peak_rss_mib=max(r["peak_rss_mib"] for r in rs),
                         cpu_s_all=[r["cpu_s"] for r in rs],
                         cpu_util=[r["cpu_s"] / r["gen_s"] for r in rs],
                         loadavg1_max=[r["loadavg1"] for r in rs],
                         **({"engine": best["engine"]} if "engine" in best else {}))
    label = "ours" if side == "ours" else f"HF (batch {args.hf_batch_size})"
    print(f"{label:>14}: best {n_out / best['gen_s']:7.1f} output tok/s ({best['gen_s']:.2f} s), "
          f"median {n_out / med:7.1f} over {len(rs)} run(s); peak RSS "
          f"{summary[side]['peak_rss_mib']:.0f} MiB (before generate {best['rss_before_gen_mib']:.0f} MiB)")
    return best


def _compare_sides(args: argparse.Namespace, prompts: list[list[int]], results: dict[str, dict],
                   summary: dict) -> None:
    """The ours/HF ratios and the token comparison (vLLM's top-5 rule)."""
    ratio = summary["ours"]["output_tok_s"] / summary["hf"]["output_tok_s"]
    ratio_med = summary["ours"]["output_tok_s_median"] / summary["hf"]["output_tok_s_median"]
    summary["ratio_ours_over_hf"] = ratio
    summary["ratio_ours_over_hf_median"] = ratio_med
    print(f"{'ratio ours/HF':>14}: {ratio:.2f}x (best runs), {ratio_med:.2f}x (medians)")
    cmp = compare(args.model_dir, prompts, results["ours"]["tokens"], results["hf"]["tokens"],
                  args.threads)
    summary["compare"] = cmp
    print(f"{'identical':>14}: {cmp['identical']}/{cmp['total']} sequences")
    for d in cmp["divergences"]:
        print(f"{'':>16}prompt {d['prompt']} first differs at output {d['position']}: ours {d['ours']} "
              f"hf {d['hf']}; HF top-5 {d['top5']}; in top-5: ours {d['ours_in_top5']} "
              f"hf {d['hf_in_top5']}; logit(hf)-logit(ours) {d['logit_gap']:.2e}")
    if cmp["divergences"]:
        print(f"{'top-5 rule':>14}: {'PASS' if cmp['top5_ok'] else 'FAIL'}")


def _print_run(side: str, r: dict, rep: int, args: argparse.Namespace, n_prompt_tok: int) -> None:
    n_out = len(r["tokens"]) * args.output_len
    label = "ours" if side == "ours" else f"HF (batch {args.hf_batch_size})"
    print(f"{label:>14} [run {rep + 1}]: {r['gen_s']:7.2f} s  {n_out / r['gen_s']:7.1f} output tok/s  "
          f"{(n_out + n_prompt_tok) / r['gen_s']:7.1f} total tok/s  peak RSS {r['peak_rss_mib']:.0f} MiB  "
          f"CPU/wall {r['cpu_s'] / r['gen_s']:.2f}  load avg {r['loadavg1']:.2f}", flush=True)


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
