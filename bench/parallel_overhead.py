#!/usr/bin/env python3
"""Per-step cost of tensor and pipeline parallelism on a tiny real model:
TP=1 (``uniproc``) vs TP=2 vs PP=2 (``mp``: MultiprocExecutor, gloo on CPU /
NCCL on CUDA), steady decode of a batch of 32.

Configs: ``tp1`` (uniproc, torch's default intra-op threads, one per core),
``tp1t1`` (the same uniproc engine, its own batches, stepped under
``torch.set_num_threads(1)``: only one uniproc engine fits in a process, as
torch.distributed is initialized once), ``tp2``, ``pp2`` and ``tp2pp2`` (mp; each
worker sets ``cpu_count // world_size`` threads itself).

What it does:
  1. builds (once, cached under ``bench/out/parallel-<family>-L<layers>-H<hidden>``)
     a random-weight checkpoint: bench/lib/models.py's tiny Llama shape (a
     transformers model type: llama, qwen2, ...) with --layers and --hidden
     (default: llama, 4 layers, hidden 64, 4 query / 2 KV heads, vocab 512);
  2. starts one ``EngineCore`` per configuration, all alive at once;
  3. runs one untimed warm-up repeat, then ``--repeats`` timed repeats, round-robin
     across the engines. In each repeat each engine gets a fresh batch of the same
     ``--batch`` requests (token-id prompts of ``--prompt-len`` random ids, greedy,
     ``ignore_eos``, max_tokens = warmup + rounds), decodes ``--warmup`` rounds
     untimed (prefill + the first decode steps), then ``--rounds`` timed, then
     drains; so every config is timed over the same context lengths (the torch
     attention backend's decode cost grows with context). A *decode round* is
     ``--batch`` generated tokens (one per request); the reported time per round is the wall time of the
     ``core.step_fn()`` calls that produced them divided by the rounds. For TP=1/TP=2
     one round is one ``EngineCore.step()``; PP=2 uses ``step_with_batch_queue``
     (two batches in flight), so one round may take several calls;
  4. reports time per round, tokens/s, the ratio to TP=1, whether the greedy
     tokens equal TP=1's, and the bytes sent between PP stages per step,
     *computed from the shapes*: the IntermediateTensors of our decoder models are
     2 tensors (``hidden_states``, ``residual``) x tokens x hidden x dtype size, plus
     the int64 length + header of ``conveyor.parallel.communication.send_tensor_dict``.

``--profile-comm`` swaps in a Worker subclass (``CommProfilingWorker`` below) that
wraps ``torch.distributed.all_reduce / all_gather / send / recv`` in each worker
process and records per step: calls, seconds and bytes of each op (on CUDA the
wrappers call ``torch.cuda.synchronize()`` before and after each op, so the time is
the op's completion time; that serializes the stream and inflates the step time).
``recv`` time includes waiting for the previous stage to finish computing, and
every op's time includes any wait for its peer, so these are upper bounds on the
transfers themselves. The measured send bytes check the computed ones.

Usage:
  .venv/bin/python bench/parallel_overhead.py                   # ~1 min on 2 CPU cores
  .venv/bin/python bench/parallel_overhead.py --quick           # smoke test
  .venv/bin/python bench/parallel_overhead.py --profile-comm    # + collective/p2p time per step
  .venv/bin/python bench/parallel_overhead.py --configs tp1,tp2,pp2,tp2pp2
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.models import TINY, ModelSpec, build  # noqa: E402
from bench.lib.stats import percentile  # noqa: E402
from conveyor.workers.worker import Worker  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "bench", "out", "parallel_overhead.json")
COMM_ENV = "CONVEYOR_BENCH_COMM_OUT"  # CONVEYOR_* also reaches Ray actors
PROFILING_WORKER = "bench.parallel_overhead:CommProfilingWorker"
# name -> (TP, PP). "tp1t1" is TP=1 with the driver's torch intra-op threads set to 1
# (the uniproc engine otherwise runs with torch's default, one per core; the mp
# workers set cpu_count // world_size themselves).
CONFIGS = {"tp1": (1, 1), "tp1t1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
perf = time.perf_counter


# ---------------------------------------------------------------------------
# Worker side (--profile-comm): timing wrappers around torch.distributed
# ---------------------------------------------------------------------------
class CommProfilingWorker(Worker):
    """A Worker that records, per step, calls / seconds / bytes of each
    torch.distributed op it makes, and writes them to $CONVEYOR_BENCH_COMM_OUT
    at shutdown. Installed by the executor's ``worker_class``."""

    OPS = ("all_reduce", "all_gather", "send", "recv")

    def init_device(self) -> None:
        """The real device set-up, then the wrappers."""
        super().init_device()
        self._steps: list[dict] = []
        self._cur: dict | None = None
        self._install()

    def _install(self) -> None:
        import torch
        import torch.distributed as dist

        cuda = self.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def nbytes(op: str, args: tuple) -> int:
            t = args[0] if op != "all_gather" else args[1]
            return t.numel() * t.element_size()

        for op in self.OPS:
            orig = getattr(dist, op)

            def wrapped(*args: Any, _op: str = op, _orig: Any = orig, **kw: Any) -> Any:
                rec = self._cur
                if rec is None:
                    return _orig(*args, **kw)
                sync()
                t0 = perf()
                r = _orig(*args, **kw)
                sync()
                s = rec["ops"].setdefault(_op, [0, 0.0, 0])
                s[0] += 1
                s[1] += perf() - t0
                s[2] += nbytes(_op, args)
                return r

            setattr(dist, op, wrapped)

    def execute_model(self, so: Any) -> Any:
        """Open this step's record around the real step."""
        self._cur = {"t0": time.time(), "tokens": so.total_num_scheduled_tokens, "ops": {}}
        self._steps.append(self._cur)
        try:
            return super().execute_model(so)
        finally:
            self._cur["t1"] = time.time()

    def sample_tokens(self, grammar_output: Any = None) -> Any:
        """Close this step's record after sampling."""
        try:
            return super().sample_tokens(grammar_output)
        finally:
            if self._cur is not None:
                self._cur["t1"] = time.time()
                self._cur = None

    def shutdown(self) -> None:
        """Write the step records to $CONVEYOR_BENCH_COMM_OUT, then shut down."""
        out = os.environ.get(COMM_ENV)
        if out and getattr(self, "_steps", None) is not None:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"rank{self.rank}-{os.getpid()}.json"), "w") as f:
                json.dump({"rank": self.rank, "steps": self._steps}, f)
        super().shutdown()


# ---------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------
def checkpoint(args: argparse.Namespace) -> str:
    """The tiny shape at --layers / --hidden (built once under bench/out)."""
    path = os.path.join(REPO, "bench", "out", f"parallel-{args.family}-L{args.layers}-H{args.hidden}")
    spec = ModelSpec(args.family, {**TINY, "num_hidden_layers": args.layers, "hidden_size": args.hidden,
                                   "intermediate_size": 2 * args.hidden, "head_dim": args.hidden // 4},
                     tokenizer_vocab=512)
    return build(path, spec)


def start_engine(name: str, path: str, args: argparse.Namespace, comm_dir: str | None) -> tuple[Any, Any]:
    """(config, EngineCore) of one configuration (--profile-comm: the profiling worker)."""
    from conveyor.engine.config import build_config
    from conveyor.engine.core.engine_core import EngineCore

    tp, pp = CONFIGS[name]
    executor_name = "uniproc" if tp * pp == 1 else "mp"
    cfg = build_config(model=path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                       executor=executor_name, max_num_seqs=max(args.batch, 32),
                       max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
                       enable_prefix_caching=False)
    if executor_name == "uniproc":
        from conveyor.executors.uniproc import UniProcExecutor
        ex = UniProcExecutor(cfg)
    else:
        from conveyor.executors.multiproc import MultiprocExecutor
        ex = MultiprocExecutor(cfg)
        if comm_dir is not None:
            os.environ[COMM_ENV] = os.path.join(comm_dir, name)  # read by the spawned workers
            ex.worker_class = PROFILING_WORKER
    try:
        core = EngineCore(cfg, ex)
    finally:
        os.environ.pop(COMM_ENV, None)
    return cfg, core


def make_requests(args: argparse.Namespace, vocab: int, max_tokens: int, tag: str) -> list[Any]:
    """The same --batch prompts for every engine in repeat `tag` (ids differ per repeat)."""
    from conveyor.engine.contracts import EngineCoreRequest
    from conveyor.engine.sampling_params import SamplingParams

    rng = random.Random(f"{args.seed}-{tag}")
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [EngineCoreRequest(request_id=f"r{tag}-{i}",
                              prompt_token_ids=[rng.randrange(4, vocab) for _ in range(args.prompt_len)],
                              sampling_params=sp, eos_token_id=1) for i in range(args.batch)]


class Run:
    """One engine and its bookkeeping."""

    def __init__(self, name: str, cfg: Any, core: Any, batch: int, threads: int | None = None) -> None:
        self.name, self.cfg, self.core, self.batch = name, cfg, core, batch
        self.threads = threads  # torch threads of this process while this engine steps
        self.tokens: dict[str, list[int]] = {}
        self.generated = 0
        self.round_s: list[float] = []  # per timed chunk: seconds per round
        self.step_s: list[float] = []  # per step_fn() call that produced output
        self.calls = 0
        self.sched_tokens: list[int] = []
        self.windows: list[tuple[float, float]] = []  # time.time() bounds of timed chunks

    def step(self) -> tuple[int, float]:
        """One step_fn() call: the tokens it produced and its seconds."""
        t0 = perf()
        outs, _ = self.core.step_fn()
        dt = perf() - t0
        n = 0
        if outs is not None:
            for o in outs.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                n += len(o.new_token_ids)
        self.generated += n
        return n, dt

    def drain(self) -> None:
        """Step until the engine has nothing left."""
        while self.core.has_work():
            self.step()
        assert not self.core.scheduler.has_unfinished_requests()

    def run_rounds(self, rounds: int, timed: bool) -> None:
        """Decode rounds under this run's torch thread count (timed or not)."""
        import torch

        prev = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            self._run_rounds(rounds, timed)
        finally:
            torch.set_num_threads(prev)

    def _run_rounds(self, rounds: int, timed: bool) -> None:
        goal = self.generated + rounds * self.batch
        w0, t0 = time.time(), perf()
        calls = 0
        while self.generated < goal:
            n, dt = self.step()
            calls += 1
            if timed and n:
                self.step_s.append(dt)
        if timed:
            self.round_s.append((perf() - t0) / rounds)
            self.calls += calls
            self.windows.append((w0, time.time()))


def comm_summary(comm_dir: str, name: str, windows: list[tuple[float, float]]) -> dict:
    """Per rank: mean calls / µs / bytes per step of each op over the timed steps."""
    res = {}
    for f in sorted(glob.glob(os.path.join(comm_dir, name, "rank*.json"))):
        with open(f) as fh:
            d = json.load(fh)
        steps = [s for s in d["steps"] if s["tokens"] > 0 and "t1" in s
                 and any(w0 <= s["t0"] and s["t1"] <= w1 for w0, w1 in windows)]
        if not steps:
            continue
        row = {"steps": len(steps), "tokens_per_step": statistics.fmean(s["tokens"] for s in steps),
               "step_us": statistics.fmean((s["t1"] - s["t0"]) * 1e6 for s in steps)}
        for op in CommProfilingWorker.OPS:
            calls = [s["ops"].get(op, [0, 0.0, 0]) for s in steps]
            if any(c[0] for c in calls):
                row[op] = {"calls": statistics.fmean(c[0] for c in calls),
                           "us": statistics.fmean(c[1] for c in calls) * 1e6,
                           "bytes": statistics.fmean(c[2] for c in calls)}
        res[f"rank{d['rank']}"] = row
    return res


def pp_bytes_per_step(hidden: int, tokens: float, dtype_size: int) -> dict:
    """What send_tensor_dict moves for {hidden_states, residual} of [tokens, hidden]."""
    import torch

    from conveyor.parallel.communication import _encode_header

    t = round(tokens)
    td = {"hidden_states": torch.empty(t, hidden), "residual": torch.empty(t, hidden)}
    header = _encode_header(td).numel() * 8
    data = 2 * t * hidden * dtype_size
    return {"tokens": t, "data_bytes": data, "header_bytes": 8 + header, "total_bytes": data + 8 + header}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tp1,tp1t1,tp2,pp2", help=f"comma list of {sorted(CONFIGS)}")
    ap.add_argument("--family", default="llama", help="a transformers model type (llama, qwen2, ...)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=10, help="untimed decode rounds per engine")
    ap.add_argument("--rounds", type=int, default=60, help="timed decode rounds per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-seconds", type=float, default=300.0, help="stop starting new repeats after this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-comm", action="store_true",
                    help="time torch.distributed all_reduce/all_gather/send/recv per step in the workers")
    ap.add_argument("--quick", action="store_true", help="smoke test: 20 rounds x 1 repeat")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.repeats, args.warmup = 20, 1, 3
    args.names = [c.strip() for c in args.configs.split(",") if c.strip()]
    for n in args.names:
        if n not in CONFIGS:
            sys.exit(f"unknown config {n!r}; choose from {sorted(CONFIGS)}")
    return args


def main() -> None:
    """Start every configuration's engine, run the repeats round-robin, report."""
    import torch

    args = _args()
    path = checkpoint(args)
    with open(os.path.join(path, "config.json")) as fh:
        hf = json.load(fh)
    comm_dir = tempfile.mkdtemp(prefix="conveyor-comm-") if args.profile_comm else None
    max_tokens = args.warmup + args.rounds
    if args.prompt_len + max_tokens > hf["max_position_embeddings"]:
        sys.exit(f"prompt_len + warmup + rounds exceed max_position_embeddings ({hf['max_position_embeddings']})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"model {path}: {hf['model_type']}, {hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, "
          f"{hf['num_attention_heads']}/{hf['num_key_value_heads']} heads, vocab {hf['vocab_size']}; device {device}; "
          f"batch {args.batch}, prompt {args.prompt_len}, {args.warmup} warm-up + {args.repeats} x {args.rounds} "
          f"timed decode rounds per config")
    runs: list[Run] = []
    try:
        _start_runs(runs, path, args, comm_dir)
        _repeats(runs, args, hf["vocab_size"], max_tokens)
    finally:
        for core in {id(r.core): r.core for r in runs}.values():
            core.shutdown()
    results = _report(runs, args, hf, device)
    if comm_dir is not None:
        _comm_report(runs, comm_dir, results)
    results["env"] = {"python": platform.python_version(), "torch": torch.__version__, "nproc": os.cpu_count(),
                      "loadavg_end": os.getloadavg(),
                      "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")


def _start_runs(runs: list[Run], path: str, args: argparse.Namespace, comm_dir: str | None) -> None:
    """One engine per configuration, all alive at once (tp1t1 shares tp1's)."""
    import torch

    for name in args.names:
        t0 = time.monotonic()
        threads = 1 if name == "tp1t1" else None
        shared = next((r for r in runs if CONFIGS[r.name] == (1, 1)), None)
        if CONFIGS[name] == (1, 1) and shared is not None:
            # One uniproc engine per process (torch.distributed is initialized once):
            # time the same engine with another thread count.
            runs.append(Run(name, shared.cfg, shared.core, args.batch, threads=threads))
            print(f"  {name}: the {shared.name} engine, stepped with torch threads {threads}")
            continue
        cfg, core = start_engine(name, path, args, comm_dir)
        run = Run(name, cfg, core, args.batch, threads=threads)
        runs.append(run)
        what = (f"torch threads {run.threads or torch.get_num_threads()} in the driver"
                if cfg.world_size == 1 else
                f"torch threads {max(1, (os.cpu_count() or 1) // cfg.world_size)} per worker")
        print(f"  {name}: engine up in {time.monotonic() - t0:.1f}s (executor {cfg.parallel.executor}, {what})")


def _repeats(runs: list[Run], args: argparse.Namespace, vocab: int, max_tokens: int) -> None:
    """Each repeat: every engine gets a fresh batch (same prompts for all engines),
    decodes --warmup rounds untimed, then --rounds timed, then drains. So every
    config is timed at the same context lengths (decode cost grows with context)."""
    t_start = time.monotonic()
    for rep in range(-1, args.repeats):  # -1: one untimed warm-up repeat
        if rep > 0 and time.monotonic() - t_start > args.max_seconds:
            print(f"  time bound reached after {rep} repeats")
            break
        for run in runs:
            for r in make_requests(args, vocab, max_tokens, tag=str(rep)):
                run.core.add_request(r)
            run.run_rounds(args.warmup, timed=False)
            run.run_rounds(args.rounds, timed=rep >= 0)
            run.drain()


def _row(run: Run, base: Run, alt_ms: float | None, base_ms: float, args: argparse.Namespace,
         hf: dict, dsize: int) -> dict:
    ms = statistics.median(run.round_s) * 1e3
    same = sum(run.tokens.get(k) == v for k, v in base.tokens.items())
    tp, pp = CONFIGS[run.name]
    return {"tp": tp, "pp": pp, "executor": run.cfg.parallel.executor, "ms_per_round": ms,
            "ms_per_round_each_repeat": [x * 1e3 for x in run.round_s],
            "spread": (max(run.round_s) - min(run.round_s)) / statistics.median(run.round_s),
            "tokens_per_s": args.batch / (ms / 1e3), "ratio_vs_tp1": ms / base_ms,
            "ratio_vs_tp1t1": ms / alt_ms if alt_ms else None,
            "calls_per_round": run.calls / (args.rounds * len(run.round_s)),
            "p50_step_ms": statistics.median(run.step_s) * 1e3 if run.step_s else None,
            "p90_step_ms": percentile(run.step_s, 90) * 1e3 if run.step_s else None,
            "threads": run.threads, "same_tokens_as_tp1": f"{same}/{len(base.tokens)}",
            "pp_bytes_per_step": pp_bytes_per_step(hf["hidden_size"], args.batch, dsize) if pp > 1 else None}


def _report(runs: list[Run], args: argparse.Namespace, hf: dict, device: str) -> dict:
    """The table of every configuration against TP=1 (and tp1t1), with the PP bytes."""
    import torch

    base = next((r for r in runs if CONFIGS[r.name] == (1, 1)), runs[0])
    dsize = torch.empty(0, dtype=getattr(torch, runs[0].cfg.model.dtype)).element_size()
    results: dict = {"args": vars(args), "model": {k: hf[k] for k in (
        "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
        "vocab_size")}, "device": device, "configs": {}}
    base_ms = statistics.median(base.round_s) * 1e3
    alt = next((r for r in runs if r.name == "tp1t1" and r is not base), None)
    alt_ms = statistics.median(alt.round_s) * 1e3 if alt else None
    print()
    print(f"| config | executor | ms / decode round (median of repeats) | best repeat | spread | tokens/s | "
          f"vs {base.name} | " + ("vs tp1t1 | " if alt else "") +
          f"step_fn calls / round | p50 step ms | p90 step ms | same tokens as {base.name} | "
          "PP bytes / step (computed) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | " + ("---: | " if alt else "")
          + "---: | ---: | ---: | :---: | ---: |")
    notes = []
    for run in runs:
        row = results["configs"][run.name] = _row(run, base, alt_ms, base_ms, args, hf, dsize)
        label = f"TP={row['tp']}, PP={row['pp']}" + (", 1 thread" if run.threads == 1 else "")
        pp_bytes = row["pp_bytes_per_step"]
        print(f"| {run.name} ({label}) | {row['executor']} | {row['ms_per_round']:.2f} | "
              f"{min(run.round_s) * 1e3:.2f} | {row['spread']:.0%} | {row['tokens_per_s']:.0f} | "
              f"{row['ratio_vs_tp1']:.2f} | " + (f"{row['ratio_vs_tp1t1']:.2f} | " if alt else "")
              + f"{row['calls_per_round']:.2f} | {row['p50_step_ms']:.2f} | {row['p90_step_ms']:.2f} | "
              f"{row['same_tokens_as_tp1']} | {pp_bytes['total_bytes'] if pp_bytes else '–'} |")
        if pp_bytes:
            notes.append(f"{run.name}: each stage boundary moves {pp_bytes['data_bytes']} B of activations per "
                         f"full-batch step (2 x {pp_bytes['tokens']} tokens x {hf['hidden_size']} hidden x "
                         f"{dsize} B) + {pp_bytes['header_bytes']} B length/header over the CPU group; "
                         f"computed from the shapes")
    print("\n".join(notes))
    return results


def _comm_report(runs: list[Run], comm_dir: str, results: dict) -> None:
    """--profile-comm: per rank, the collectives' and p2p's calls, µs and bytes per step."""
    print("\ncommunication per step, measured in the workers (mean over timed steps):")
    print("| config | rank | steps | tokens/step | worker step µs | all_reduce calls / µs | "
          "all_gather calls / µs | send calls / µs / bytes | recv calls / µs / bytes |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- | --- | --- |")
    for run in runs:
        if CONFIGS[run.name] == (1, 1):
            continue
        cs = comm_summary(comm_dir, run.name, run.windows)
        results["configs"][run.name]["comm"] = cs
        for rank, row in cs.items():
            def cell(op: str, with_bytes: bool = False, row: dict = row) -> str:
                o = row.get(op)
                if not o:
                    return "–"
                s = f"{o['calls']:.1f} / {o['us']:.0f}"
                return s + f" / {o['bytes']:.0f}" if with_bytes else s
            print(f"| {run.name} | {rank} | {row['steps']} | {row['tokens_per_step']:.1f} | {row['step_us']:.0f} | "
                  f"{cell('all_reduce')} | {cell('all_gather')} | {cell('send', True)} | {cell('recv', True)} |")


if __name__ == "__main__":
    main()
