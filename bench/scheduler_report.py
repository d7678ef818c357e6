"""bench/scheduler.py's vLLM side and report: the peer harness's numbers
(recorded, or a live run of ../shared/peers/vllm_sched/vllm_sched_bench.py
in this session), ours beside them per workload (ratios, agreement of the
schedules) and the printed tables.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any


def load_vllm(path: str) -> dict | None:
    """Recorded vLLM results (None, with a warning, if unreadable)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"warning: cannot read vLLM results {path}: {e}", file=sys.stderr)
        return None


def run_vllm_live(python: str, peer_dir: str, workloads: list[str], args: argparse.Namespace) -> dict | None:
    """The peer harness run live on the same workloads and core; None if it fails."""
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



def _f(v: Any, fmt: str = "{:.0f}", none: str = "-") -> str:
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
    """Both tables: ours against vLLM per workload, then our details."""
    hw = results["hardware"]
    lines = [
        f"Conveyor scheduler vs vLLM 0.32 Scheduler | Python {hw['python']} | "
        f"{hw['cpu_model']} | nproc={hw['nproc']} affinity={hw['cpu_affinity']} | "
        f"log_stats={results['settings']['log_stats']} | repeats={results['settings']['repeats']}"
        f" | vLLM numbers: {results['vllm']['source']}",
        "µs per engine step (schedule() + update_from_output()), medians/p90 pooled over all "
        "timed steps of all runs; ratio = ours/vLLM step median (< 1: we are cheaper); best = "
        "ratio of the lowest per-run step medians (robust to a slow period hitting some runs)",
    ]
    lines += _main_rows(results) + [""] + _detail_rows(results) + [""]
    lines.append("sched= : our schedule digest equals vLLM's (identical per-step token "
                 "assignment); det: identical schedule, outputs, preemptions and prefix hits in "
                 "every run; cpu/wall < 100% means other processes took the core part of the time; "
                 "step CPU med = median thread CPU time of schedule()+update (not affected by "
                 "being descheduled; vLLM's harness does not record it)")
    return "\n".join(lines)


def _main_rows(results: dict) -> list[str]:
    cmp_ = results["comparison"]
    hdr = (f"{'workload':12s} {'ours med':>9s} {'ours p90':>9s} {'vLLM med':>9s} {'vLLM p90':>9s} "
           f"{'ratio':>6s} {'best':>5s} {'us/req ours':>11s} {'us/req vLLM':>11s} {'ms/run ratio':>12s} "
           f"{'preempt o/v':>12s} {'prefix hits ours / vLLM':>24s} {'steps o/v':>10s} "
           f"{'sched=':>6s} {'det':>4s}")
    lines = [hdr, "-" * len(hdr)]
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
    return lines


def _detail_rows(results: dict) -> list[str]:
    cmp_ = results["comparison"]
    lines = ["ours, details (µs per step; add = all add_request calls of one run, incl. "
             "prompt hashing when prefix caching is on):"]
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
    return lines
