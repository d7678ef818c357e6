#!/usr/bin/env python3
"""Executor overhead per engine step: the RayExecutor data plane with a no-op model,
next to the same fan-out done with plain Ray actor calls.

What is timed (all in one run, on one local Ray instance, interleaved round-robin):

- ``ours``   : ``executor.execute_model(so); executor.sample_tokens()`` on a
  ``RayExecutor(cfg, worker_class="noop_worker:TimedNoopWorker")`` with TP=2 (the no-op
  worker of tests/cpu/noop_worker.py: that folder goes on sys.path and PYTHONPATH, so the
  Ray workers import it too).
  The SchedulerOutput is msgspec-encoded once, HMAC-signed and pushed to both
  ranks over ZMQ; the output rank replies with a ModelRunnerOutput.
- ``ray``    : the peer. Two plain Ray actors (``num_cpus=1`` each) with a method
  ``execute(so)`` that does the NoopWorker's work and returns a ModelRunnerOutput
  (the output rank only; the other returns None, as our non-output rank does),
  driven per step as ``ray.get([w.execute.remote(so) for w in workers])``. The
  SchedulerOutput object is passed as is: Ray pickles it for each call.
- ``core``   : full ``EngineCore.step()`` (schedule + execute + sample + update)
  on the same RayExecutor, 256 requests in steady decode.
- ``core-inproc``: the same ``EngineCore.step()`` with the NoopWorker called
  in-process (no IPC): the scheduler's share of ``core``.

The SchedulerOutputs of ``ours`` and ``ray`` are a recorded trace of real
all-decode steps: a real ``Scheduler`` with 256 requests (prompts of 16-47 tokens,
serve-style request ids ``cmpl-<32 hex>-0``) is driven to steady decode with fake
one-token outputs, then ``--trace-len`` consecutive decode steps are recorded and
replayed cyclically (256 cached requests, 1 token each, ``new_block_ids`` None
except for the ~1/16 of requests that cross a 16-token block boundary that step).

Method: ``perf_counter_ns`` around each step; gc collected, frozen and disabled
during the timed loops (untimed collect every 500 steps); ``--warmup`` untimed
steps per mode; then ``--rounds`` rounds of ``--steps / --rounds`` steps per
mode, round-robin, each mode bounded by ``--max-seconds`` in all.

Usage:
  .venv/bin/python bench/executor_overhead.py                 # ~1 min
  .venv/bin/python bench/executor_overhead.py --quick         # smoke test
  .venv/bin/python bench/executor_overhead.py --profile       # + cProfile and worker timestamps
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import hmac
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The no-op worker lives with the tests (tests/cpu/noop_worker.py, the PP-overlap test uses it).
TESTS_SUPPORT = os.path.join(REPO, "tests", "cpu")
for _p in (TESTS_SUPPORT, REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)
# The Ray workers the local instance starts inherit this environment.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_SUPPORT, REPO, os.environ.get("PYTHONPATH")) if p)

import msgspec  # noqa: E402
import ray  # noqa: E402

from bench.lib.stats import percentile  # noqa: E402
from conveyor.engine.config import EngineConfig, build_config  # noqa: E402
from conveyor.engine.contracts import (  # noqa: E402
    EngineCoreRequest,
    KVCacheInfo,
    ModelRunnerOutput,
    SchedulerOutput,
)
from conveyor.engine.core.engine_core import EngineCore  # noqa: E402
from conveyor.engine.core.request import Request  # noqa: E402
from conveyor.engine.core.scheduler import Scheduler  # noqa: E402
from conveyor.engine.sampling_params import SamplingParams  # noqa: E402
from conveyor.executors.base import Executor  # noqa: E402
from conveyor.executors.messages import WorkerCommand, WorkerReply  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "bench", "out", "executor_overhead.json")
NOOP = "noop_worker:TimedNoopWorker"  # NoopWorker plus the step_timeline RPC
PROMPT_LEN = 32
GC_EVERY = 500
perf_ns = time.perf_counter_ns


# ---------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------
def make_config(args: argparse.Namespace) -> EngineConfig:
    """TP ranks on the Ray executor, room for --requests requests of --max-model-len."""
    max_len = args.max_model_len
    blocks = args.requests * (max_len // 16 + 1) + 1
    return build_config(tensor_parallel_size=args.tp, executor="ray", max_num_seqs=args.requests,
                        max_num_batched_tokens=max(8192, args.requests * PROMPT_LEN),
                        max_model_len=max_len, num_gpu_blocks=blocks, enable_prefix_caching=False)


def make_requests(n: int, max_tokens: int, seed: int, id_style: str) -> list[EngineCoreRequest]:
    """n requests of max_tokens greedy tokens (serve-style or offline request ids)."""
    rng = random.Random(seed)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for i in range(n):
        rid = f"cmpl-{rng.getrandbits(128):032x}-0" if id_style == "serve" else f"req{i}-0"
        n = rng.randint(PROMPT_LEN // 2, PROMPT_LEN * 3 // 2 - 1)
        out.append(EngineCoreRequest(request_id=rid, prompt_token_ids=[rng.randrange(4, 500) for _ in range(n)],
                                     sampling_params=sp, eos_token_id=1))
    return out


def noop_output(so: SchedulerOutput) -> ModelRunnerOutput:
    """What NoopWorker.sample_tokens returns: one token per scheduled request."""
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[7] for _ in ids])


def is_steady_decode(so: SchedulerOutput, n: int) -> bool:
    """A step of every running request, one token each, nothing new or finished."""
    return (not so.scheduled_new_reqs and so.scheduled_cached_reqs.num_reqs == n
            and so.total_num_scheduled_tokens == n and not so.finished_req_ids)


def record_decode_trace(cfg: EngineConfig, args: argparse.Namespace) -> list[SchedulerOutput]:
    """Drive a real Scheduler to steady decode; record `trace_len` decode steps."""
    sched = Scheduler(cfg, cfg.cache.num_gpu_blocks, log_stats=True)
    for ecr in make_requests(args.requests, args.max_model_len - 2 * PROMPT_LEN, args.seed, args.id_style):
        sched.add_request(Request.from_engine_core_request(ecr, cfg.max_model_len))
    trace: list[SchedulerOutput] = []
    for _ in range(args.trace_len + 64):
        so = sched.schedule()
        sched.update_from_output(so, noop_output(so))
        if is_steady_decode(so, args.requests):
            trace.append(so)
            if len(trace) == args.trace_len:
                return trace
    raise RuntimeError("scheduler did not reach steady decode")


# ---------------------------------------------------------------------------
# The peer: plain Ray actor calls
# ---------------------------------------------------------------------------
@ray.remote(num_cpus=1)
class PlainRayWorker:
    """The peer: a plain Ray actor doing NoopWorker's work per call."""
    def __init__(self, output_rank: bool) -> None:
        self.output_rank = output_rank

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step: the output rank answers, the other returns None (as ours)."""
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {}, [])
        out = noop_output(so)
        return out if self.output_rank else None

    def ping(self) -> int:
        """The actor's pid (it is up)."""
        return os.getpid()


# ---------------------------------------------------------------------------
# In-process no-op executor (EngineCore baseline without IPC)
# ---------------------------------------------------------------------------
class InprocNoopExecutor(Executor):
    """NoopWorker called in this process: EngineCore.step() without any IPC."""
    def __init__(self, config: EngineConfig) -> None:
        from noop_worker import NoopWorker
        self.config = config
        self.worker = NoopWorker(config)

    def initialize(self) -> KVCacheInfo:
        """The no-op worker's KV cache info."""
        return self.worker.kv_info(self.worker.determine_num_blocks())

    def execute_model(self, so: SchedulerOutput, non_block: bool = False) -> Any:
        """The step, in process."""
        return self.worker.execute_model(so)

    def sample_tokens(self, grammar_output: Any = None, non_block: bool = False) -> Any:
        """One token per scheduled request."""
        return self.worker.sample_tokens(grammar_output)


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------
def summary(ns: list[int]) -> dict:
    """Step times (ns) as µs percentiles, mean, min and steps/s."""
    us = [x / 1000 for x in ns]
    return {"n": len(us), "p50_us": percentile(us, 50), "p90_us": percentile(us, 90), "p99_us": percentile(us, 99),
            "mean_us": statistics.fmean(us), "min_us": min(us),
            "steps_per_s": 1e6 / statistics.fmean(us)}


def timed_loop(step: Callable[[int], None], n: int, deadline: float, cpu: list[float]) -> list[int]:
    """Up to n timed calls of step (gc frozen and off, an untimed collection
    every GC_EVERY); appends the loop's process CPU time to ``cpu``."""
    out: list[int] = []
    gc.collect()
    gc.freeze()
    gc.disable()
    c0 = time.process_time()
    try:
        for i in range(n):
            if time.monotonic() > deadline:
                break
            t0 = perf_ns()
            step(i)
            out.append(perf_ns() - t0)
            if i % GC_EVERY == GC_EVERY - 1:
                gc.collect()
    finally:
        cpu.append(time.process_time() - c0)
        gc.enable()
        gc.unfreeze()
    return out


def component_costs(so: SchedulerOutput, secret: bytes) -> dict:
    """Driver-side microbenchmarks of one step's serialization work (µs)."""
    import pickle

    import ray.cloudpickle as cp

    cmd = WorkerCommand("step", 1, scheduler_output=so)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(WorkerCommand)
    payload = enc.encode(cmd)
    reply = WorkerReply(0, 1, output=noop_output(so))
    rpayload = enc.encode(reply)
    rdec = msgspec.msgpack.Decoder(WorkerReply)
    pick = cp.dumps(so, protocol=5)

    def t(fn: Callable[[], object], n: int = 2000) -> float:
        fn()
        t0 = perf_ns()
        for _ in range(n):
            fn()
        return (perf_ns() - t0) / n / 1000

    return {
        "command_bytes": len(payload), "reply_bytes": len(rpayload), "pickled_so_bytes": len(pick),
        "msgspec_encode_cmd_us": t(lambda: enc.encode(cmd)),
        "msgspec_decode_cmd_us": t(lambda: dec.decode(payload)),
        "hmac_sha256_cmd_us": t(lambda: hmac.new(secret, payload, hashlib.sha256).digest()),
        "msgspec_encode_reply_us": t(lambda: enc.encode(reply)),
        "msgspec_decode_reply_us": t(lambda: rdec.decode(rpayload)),
        "noop_output_us": t(lambda: noop_output(so)),
        "cloudpickle_dumps_so_us": t(lambda: cp.dumps(so, protocol=5)),
        "pickle_loads_so_us": t(lambda: pickle.loads(pick)),
    }


def worker_breakdown(executor: Any, sends: list[float], dones: list[float], n: int) -> dict:
    """Align the last n driver steps with the workers' step timelines
    (time.time() on both sides; same host clock)."""
    tl = executor.collective_rpc("step_timeline")
    res = {}
    for rank, floats in enumerate(tl):
        triples = [floats[i:i + 3] for i in range(0, len(floats), 3)][-n:]
        m = min(len(triples), len(sends))
        s, d, tr = sends[-m:], dones[-m:], triples[-m:]
        recv = [(w0 - s0) * 1e6 for s0, (_, w0, _) in zip(s, tr)]
        handle = [(w1 - w0) * 1e6 for _, w0, w1 in tr]
        row = {"send_to_worker_start_p50_us": percentile(recv, 50), "worker_handle_p50_us": percentile(handle, 50)}
        if rank == 0:  # output rank for PP=1
            back = [(d0 - w1) * 1e6 for d0, (_, _, w1) in zip(d, tr)]
            row["worker_end_to_driver_done_p50_us"] = percentile(back, 50)
        res[f"rank{rank}"] = row
    total = [(d0 - s0) * 1e6 for s0, d0 in zip(sends[-n:], dones[-n:])]
    res["driver_total_p50_us"] = percentile(total, 50)
    return res


# ---------------------------------------------------------------------------
def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3000, help="timed steps per mode (all rounds)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--trace-len", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=60.0, help="time bound per mode")
    ap.add_argument("--id-style", choices=["serve", "offline"], default="serve")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-core", action="store_true", help="skip the EngineCore.step() modes")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed run: cProfile of the driver loop + worker timestamps")
    ap.add_argument("--quick", action="store_true", help="smoke test: 200 steps, 1 round")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds, args.warmup = 200, 1, 20
    return args


def main() -> None:
    """Record the decode trace, start the executors, time every mode, report."""
    args = _args()
    cfg = make_config(args)
    trace = record_decode_trace(cfg, args)
    nb = [sum(b is not None for b in so.scheduled_cached_reqs.new_block_ids) for so in trace]
    print(f"decode trace: {len(trace)} steps x {args.requests} cached requests, 1 token each; "
          f"requests with new blocks per step: mean {statistics.fmean(nb):.1f}, max {max(nb)}")

    ray.init(address="local", num_cpus=8, include_dashboard=False)
    from conveyor.executors.ray_executor import RayExecutor

    cores: list[EngineCore] = []
    results: dict = {"args": vars(args)}
    try:
        t0 = time.monotonic()
        executor = RayExecutor(cfg, worker_class=NOOP)
        cores.append(EngineCore(cfg, executor))
        print(f"RayExecutor TP={args.tp} with NoopWorker up in {time.monotonic() - t0:.1f}s "
              f"(worker pids {getattr(executor, 'worker_pids', '?')})")
        costs = component_costs(trace[0], executor.keys.mac)
        results["components"] = costs
        print("per-step serialization (driver, µs): " + ", ".join(
            f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in costs.items()))
        modes = _modes(args, cfg, executor, trace, cores)
        _report(_time_modes(args, modes, cores), results, args)
        if args.profile:
            results["profile"] = profile(executor, trace, args)
    finally:
        if cores:
            cores[0].shutdown()
        ray.shutdown()
    results["env"] = {"python": platform.python_version(), "ray": ray.__version__,
                      "msgspec": msgspec.__version__, "nproc": os.cpu_count(),
                      "loadavg_end": os.getloadavg(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")


def _modes(args: argparse.Namespace, cfg: EngineConfig, executor: Any, trace: list[SchedulerOutput],
           cores: list[EngineCore]) -> dict[str, Callable[[int], None]]:
    """The timed step of each mode: ours, plain Ray, and (unless --no-core)
    EngineCore.step() over Ray and in-process (appended to ``cores``)."""
    plain = [PlainRayWorker.remote(i == 0) for i in range(args.tp)]
    ray.get([w.ping.remote() for w in plain])
    n = len(trace)

    def ours(i: int) -> None:
        executor.execute_model(trace[i % n])
        out = executor.sample_tokens()
        assert out is not None and len(out.req_ids) == args.requests

    def plain_ray(i: int) -> None:
        outs = ray.get([w.execute.remote(trace[i % n]) for w in plain])
        assert outs[0] is not None and len(outs[0].req_ids) == args.requests

    modes: dict[str, Callable[[int], None]] = {"ours": ours, "ray": plain_ray}
    if args.no_core:
        return modes
    cores.append(EngineCore(cfg, InprocNoopExecutor(cfg)))
    for c in cores:
        for ecr in make_requests(args.requests, args.max_model_len - 2 * PROMPT_LEN, args.seed, args.id_style):
            c.add_request(ecr)
    modes["core"] = lambda i, c=cores[0]: c.step()
    modes["core-inproc"] = lambda i, c=cores[1]: c.step()
    return modes


def _time_modes(args: argparse.Namespace, modes: dict[str, Callable[[int], None]],
                cores: list[EngineCore]) -> dict[str, dict]:
    """Warm-up (bringing the cores to steady decode), then --rounds rounds of
    every mode, round-robin, each mode bounded by --max-seconds in all."""
    for fn in modes.values():
        for i in range(args.warmup):
            fn(i)
    for c in cores:
        assert len(c.scheduler.requests) == args.requests
    per_round = max(1, args.steps // args.rounds)
    if not args.no_core:
        steps_core_max = args.max_model_len - 2 * PROMPT_LEN - 2 * args.warmup - 64
        per_round = min(per_round, steps_core_max // args.rounds)
    samples: dict[str, list[int]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    walls: dict[str, float] = {m: 0.0 for m in modes}
    tstart = time.monotonic()
    for _ in range(args.rounds):
        for name, fn in modes.items():
            w0 = time.monotonic()
            deadline = w0 + max(0.0, args.max_seconds - walls[name])
            samples[name] += timed_loop(fn, per_round, deadline, cpu[name])
            walls[name] += time.monotonic() - w0
    print(f"timed loops: {time.monotonic() - tstart:.1f}s, {per_round} steps/round x {args.rounds} rounds")
    return {m: summary(v) | {"driver_cpu_per_step_us": sum(cpu[m]) / max(1, len(v)) * 1e6}
            for m, v in samples.items()}


def _report(summ: dict[str, dict], results: dict, args: argparse.Namespace) -> None:
    """The table, plain Ray over ours, the goals, the executor's share of a core step."""
    results["modes"] = summ
    print()
    print("| mode | steps | p50 µs | p90 µs | p99 µs | mean µs | min µs | steps/s | driver CPU µs/step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for m, s in summ.items():
        print(f"| {m} | {s['n']} | {s['p50_us']:.0f} | {s['p90_us']:.0f} | {s['p99_us']:.0f} | "
              f"{s['mean_us']:.0f} | {s['min_us']:.0f} | {s['steps_per_s']:.0f} | "
              f"{s['driver_cpu_per_step_us']:.0f} |")
    o, p = summ["ours"], summ["ray"]
    ratios = {"p50": p["p50_us"] / o["p50_us"], "p99": p["p99_us"] / o["p99_us"],
              "mean": p["mean_us"] / o["mean_us"]}
    results["ray_over_ours"] = ratios
    print(f"\nplain Ray / ours: p50 {ratios['p50']:.2f}x, p99 {ratios['p99']:.2f}x, mean {ratios['mean']:.2f}x")
    print(f"goal p50 <= 1000 µs: {'MET' if o['p50_us'] <= 1000 else 'MISSED'} ({o['p50_us']:.0f} µs); "
          f"goal >= 3x plain Ray: {'MET' if ratios['p50'] >= 3 else 'MISSED'} ({ratios['p50']:.2f}x)")
    if not args.no_core:
        extra = summ["core"]["p50_us"] - summ["core-inproc"]["p50_us"]
        results["core_minus_inproc_p50_us"] = extra
        print(f"EngineCore.step(): over Ray {summ['core']['p50_us']:.0f} µs vs in-process "
              f"{summ['core-inproc']['p50_us']:.0f} µs p50 -> executor adds {extra:.0f} µs")


def profile(executor: Any, trace: list[SchedulerOutput], args: argparse.Namespace) -> dict:
    """Worker timestamps of 2000 steps, then a cProfile of 2000 more."""
    import cProfile
    import io
    import pstats

    L, n = len(trace), 2000
    sends, dones = [], []
    for i in range(n):  # timestamps (not under cProfile)
        s = time.time()
        executor.execute_model(trace[i % L])
        executor.sample_tokens()
        sends.append(s)
        dones.append(time.time())
    br = worker_breakdown(executor, sends, dones, n)
    print("\nworker timestamps (p50, µs):", json.dumps(br))
    pr = cProfile.Profile()
    pr.enable()
    for i in range(n):
        executor.execute_model(trace[i % L])
        executor.sample_tokens()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
    print("\ncProfile of the driver (main thread only), by tottime:\n" + buf.getvalue())
    path = os.path.join(os.path.dirname(args.out), "executor_overhead.prof")
    pr.dump_stats(path)
    return {"worker_timestamps": br, "prof": path}


if __name__ == "__main__":
    main()
