#!/usr/bin/env python3
"""Wall-clock stage timers, plain vs speculative, interleaved in one process.

Builds bench/spec_decode.py's workload (same model, prompts and sampling),
starts one speculative engine in this process (uniproc, the engine core
in-process) and alternates timed generate() calls with its scheduler's
speculation on and off
(`--rounds` each, after one untimed warm-up call each) and reports per call:
wall time and, from perf_counter timers wrapped around the engine's methods,

- schedule:  Scheduler.schedule
- proposer:  SpecDecodeScheduling.propose (inside update_from_output)
- prep:      ModelRunner.execute_model outside the model's forward
             (state diff, inputs, attention metadata, logits gather)
- forward:   the model's forward (inside set_forward_context)
- sample:    ModelRunner.sample_tokens (sampling or verification)
- update:    Scheduler.update_from_output minus the proposer
- other:     wall minus all of the above (the LLM / core loop, outputs)
- gc_ms:     time in Python's garbage collector (inside the stages above)

plus the step count, the steps that verified drafts, and the mean forward
time of plain vs drafting steps. Medians over rounds; min..max in brackets.

Usage:
  .venv/bin/python bench/spec_decode_stages.py --batch 32 --workload no-repeat --rounds 5
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

STAGES = ("schedule", "proposer", "prep", "forward", "sample", "update", "other")


class Timers:
    """Accumulators of the engine currently generating (one at a time)."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.spec_step = False
        self.fwd: list[float] = []  # per step, this call

    def reset(self) -> None:
        self.acc = defaultdict(float)
        self.counts = defaultdict(int)
        self.fwd = []


T = Timers()


def _wrap(cls: type, name: str, stage: str) -> None:
    fn = getattr(cls, name)

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            T.acc[stage] += time.perf_counter() - t0

    setattr(cls, name, timed)


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        T.acc["_gc_t0"] = time.perf_counter()
    else:
        T.acc["gc"] += time.perf_counter() - T.acc["_gc_t0"]
        T.counts["gc"] += 1


def install() -> None:
    import gc

    gc.callbacks.append(_gc_timer)
    import conveyor.engine.core.scheduler as sched_mod
    import conveyor.engine.spec_decode.scheduling as spec_mod
    import conveyor.workers.model_runner as mr

    _wrap(sched_mod.Scheduler, "schedule", "schedule")
    _wrap(sched_mod.Scheduler, "update_from_output", "update_all")
    _wrap(spec_mod.SpecDecodeScheduling, "propose", "proposer")
    _wrap(mr.ModelRunner, "sample_tokens", "sample")
    exe = mr.ModelRunner.execute_model

    def execute(self, so, *a, **kw):
        T.spec_step = bool(so.scheduled_spec_decode_tokens)
        t0 = time.perf_counter()
        try:
            return exe(self, so, *a, **kw)
        finally:
            T.acc["execute"] += time.perf_counter() - t0
            T.counts["steps"] += 1
            T.counts["spec_steps"] += T.spec_step

    mr.ModelRunner.execute_model = execute
    ctx = mr.set_forward_context

    @contextlib.contextmanager
    def forward_ctx(*a, **kw):
        t0 = time.perf_counter()
        with ctx(*a, **kw):
            yield
        dt = time.perf_counter() - t0
        T.acc["forward"] += dt
        T.fwd.append(-dt if T.spec_step else dt)  # negative: a step that verified drafts
        key = "fwd_spec" if T.spec_step else "fwd_plain"
        T.acc[key] += dt
        T.counts[key] += 1

    mr.set_forward_context = forward_ctx


def one_call(llm, prompts, sp) -> dict:
    T.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    a, c = T.acc, T.counts
    r = dict(wall=wall, schedule=a["schedule"], proposer=a["proposer"],
             prep=a["execute"] - a["forward"], forward=a["forward"], sample=a["sample"],
             update=a["update_all"] - a["proposer"], steps=c["steps"], spec_steps=c["spec_steps"],
             fwd_plain_ms=1e3 * a["fwd_plain"] / max(c["fwd_plain"], 1),
             fwd_spec_ms=1e3 * a["fwd_spec"] / max(c["fwd_spec"], 1),
             fwd_steps=list(T.fwd), gc_ms=1e3 * a["gc"], gc_runs=c["gc"],
             tok_s=sum(len(o.outputs[0].token_ids) for o in outs) / wall,
             digest=hash(tuple(tuple(o.outputs[0].token_ids) for o in outs)) & 0xFFFFFFFF)
    r["other"] = wall - sum(r[s] for s in STAGES if s != "other")
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workload", default="no-repeat", choices=["no-repeat", "copy-heavy"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--copy-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import spec_decode as sd
    from offline_throughput import build_model

    from conveyor.engine import LLM, SamplingParams

    model_dir = build_model(sd.DEFAULT_MODEL_DIR, sd.MODEL_SPEC)
    if args.workload == "copy-heavy":
        prompts, temp = sd.copy_heavy_prompts(model_dir, args.batch, args.copy_len, args.seed), 0.0
    else:
        prompts, temp = sd.no_repeat_prompts(model_dir, args.batch, args.seed), 1.0
    sp = SamplingParams(max_tokens=args.output_len, temperature=temp, ignore_eos=True,
                        seed=args.seed if temp > 0 else None)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    install()
    # One engine (a process holds one): "plain" runs it with the scheduler's
    # speculative part switched off, the only place speculation is decided
    # (no drafts -> the runner's plain path), so both sides share the same
    # weights, KV cache and warm-up.
    llm = LLM(model=model_dir, max_num_seqs=args.batch, speculative_config=spec)
    sched = llm.engine.scheduler
    sides = {"plain": None, "spec": sched.spec}
    for side in sides.values():
        sched.spec = side
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    results: dict[str, list[dict]] = {k: [] for k in sides}
    for i in range(args.rounds):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for name in order:
            sched.spec = sides[name]
            results[name].append(one_call(llm, prompts, sp))
    llm.shutdown()
    report(args, results)
    return 0


def _med(rs: list[dict], key: str) -> tuple[float, float, float]:
    v = [r[key] for r in rs]
    return statistics.median(v), min(v), max(v)


def report(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    print(f"{args.workload} batch {args.batch}, {args.rounds} rounds, loadavg "
          f"{os.getloadavg()[0]:.2f}; ms per generate() call: median [min..max]")
    for key in ("wall", *STAGES):
        cells = []
        for name, rs in results.items():
            m, lo, hi = _med(rs, key)
            cells.append(f"{name} {m * 1e3:7.1f} [{lo * 1e3:6.1f}..{hi * 1e3:6.1f}]")
        print(f"  {key:>9}: " + "   ".join(cells))
    for key in ("steps", "spec_steps", "fwd_plain_ms", "fwd_spec_ms", "gc_ms", "gc_runs", "tok_s"):
        print(f"  {key:>12}: " + "   ".join(f"{n} {_med(rs, key)[0]:.2f}" for n, rs in results.items()))
    _report_steps(results)
    ratios = [s["tok_s"] / p["tok_s"] for p, s in zip(results["plain"], results["spec"])]
    print(f"  spec/plain tok/s per round: {' '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f}")
    digests = {n: {r['digest'] for r in rs} for n, rs in results.items()}
    print(f"  digests: {digests}")


def _report_steps(results: dict[str, list[dict]]) -> None:
    """Forward time per step index, median over rounds: the steps where the
    spec side verified drafts against the same steps of the plain side."""
    per = {n: [r["fwd_steps"] for r in rs] for n, rs in results.items()}
    if len({len(f) for fs in per.values() for f in fs}) != 1:
        return  # step counts differ (drafts accepted): no step-by-step pairing
    med = {n: [statistics.median(abs(f[i]) for f in fs) for i in range(len(fs[0]))]
           for n, fs in per.items()}
    drafted = [i for i in range(len(med["spec"])) if any(f[i] < 0 for f in per["spec"])]
    rest = [i for i in range(len(med["spec"])) if i not in drafted]
    for label, idx in (("drafting steps", drafted), ("other steps", rest)):
        p, s = (sum(med[n][i] for i in idx) * 1e3 for n in ("plain", "spec"))
        print(f"  forward, {label} ({len(idx)}: {idx[:8]}): plain {p:.2f} ms, spec {s:.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
