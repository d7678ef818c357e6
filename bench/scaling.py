#!/usr/bin/env python3
"""Cost as work grows: Conveyor and vLLM's CPU build on the same cores, one
axis at a time, with the ratio at every point.

Axes (offline ``generate``, greedy, ``ignore_eos``, every prompt the same
length, all requests in flight at once, prefix caching off):
  context  prompt length 256 -> 8k at batch 1 (the 30M Llama with 8448 positions)
  batch    1 -> 256 requests of 256 prompt tokens (the 30M Llama)
  model    30M -> Qwen2-0.5B -> Llama-1B shapes (bench/lib/models.py), batch 16
Each point runs each engine once in a fresh process (compare_vllm's runners:
same threads, same KV-cache size, tokens compared by digest), one timed
generate after a warm-up. tok/s = output tokens / wall; TPOT here is
wall / output tokens per request (all requests run together, so it is the
time per decode step, prefill included).

``--grid reduced`` (default) keeps each axis to a few points a shared 2-core
box runs in minutes; ``--grid full`` is the whole range.
Writes bench/out/scaling.json and bench/out/scaling.png (bench/lib/png_plot.py,
standard library only; ``--plot-only FILE.json`` redraws it).

Usage:
  .venv/bin/python bench/scaling.py --axes batch,context
  .venv/bin/python bench/scaling.py --plot-only bench/out/scaling.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "bench", "out")
if REPO not in sys.path:
    sys.path.insert(0, REPO)

GRIDS = {
    "reduced": {"context": [256, 1024, 4096, 8192], "batch": [1, 16, 64, 256],
                "model": ["30m", "0.5b", "1b"]},
    "full": {"context": [256, 512, 1024, 2048, 4096, 8192], "batch": [1, 4, 16, 64, 128, 256],
             "model": ["30m", "0.5b", "1b"]},
}
OUTPUT_LEN = {"context": 32, "batch": 32, "model": 32}


def point_workload(axis: str, value: int | str) -> tuple[str, dict]:
    """(bench model name, compare_vllm workload) for one point of an axis."""
    if axis == "context":
        ctx = int(value)
        return "30m8k", dict(num_prompts=1, max_num_seqs=1, prompt_len=ctx,
                             max_model_len=ctx + OUTPUT_LEN[axis] + 16)
    if axis == "batch":
        b = int(value)
        return "30m", dict(num_prompts=b, max_num_seqs=b, prompt_len=256, max_model_len=512)
    return str(value), dict(num_prompts=16, max_num_seqs=16, prompt_len=256, max_model_len=512)


def run_point(axis: str, value: int | str, threads: int, dtype: str) -> dict:
    """Both engines at one point of an axis (fresh processes); tok/s, TPOT, ratio."""
    from bench import compare_vllm
    from bench.lib.models import model_dir

    model, wl = point_workload(axis, value)
    wl.update(output_len=OUTPUT_LEN[axis], dtype=dtype, gen_repeats=1)
    path = model_dir(model)
    row: dict = {"axis": axis, "value": value, "model": model, **wl}
    for who, fn in (("conveyor", compare_vllm._run_ours), ("vllm", compare_vllm._run_vllm)):
        r = fn(path, wl, threads)
        r["tpot_ms"] = round(1e3 * r["best_wall_s"] / wl["output_len"], 2)
        row[who] = r
    row["ratio"] = round(row["conveyor"]["tok_per_s"] / row["vllm"]["tok_per_s"], 3)
    row["tokens_identical"] = row["conveyor"]["ids_sha"] == row["vllm"]["ids_sha"]
    return row


def plot(rows: list[dict], path: str) -> None:
    """Two rows of panels per axis: output tok/s and TPOT of both engines
    (the tok/s panel's title lists the ratio at every point)."""
    from bench.lib.png_plot import Chart, Series, save_charts

    axes = [a for a in ("context", "batch", "model") if any(r["axis"] == a for r in rows)]
    charts = []
    for key, label in (("tok_per_s", "output tok/s"), ("tpot_ms", "tpot ms")):
        for axis in axes:
            pts = [r for r in rows if r["axis"] == axis]
            xs = list(range(len(pts)))
            ratios = " ".join(f"{r['ratio']:.2f}x" for r in pts)
            charts.append(Chart(f"{axis}: {label}" + (f" (ratio {ratios})" if key == "tok_per_s" else ""),
                                axis, label, [Series(who, xs, [r[who][key] for r in pts])
                                              for who in ("conveyor", "vllm")],
                                categories=[str(r["value"]) for r in pts]))
    save_charts(path, charts, cols=len(axes), w=520, h=360)


def main() -> int:
    """Each axis' points (appended to --json), then the PNG; or --plot-only."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--axes", default="context,batch,model")
    ap.add_argument("--grid", default="reduced", choices=tuple(GRIDS))
    ap.add_argument("--points", default=None, help="override one axis' points, e.g. 256,1024")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", default=os.path.join(OUT, "scaling.json"))
    ap.add_argument("--png", default=os.path.join(OUT, "scaling.png"))
    ap.add_argument("--plot-only", default=None, help="redraw the PNG from this JSON")
    a = ap.parse_args()
    if a.plot_only:
        with open(a.plot_only) as f:
            plot(json.load(f)["rows"], a.png)
        print(f"wrote {a.png}")
        return 0
    os.makedirs(OUT, exist_ok=True)
    rows = []
    if os.path.exists(a.json):  # runs append, so one axis at a time fits a lock slot
        with open(a.json) as f:
            rows = [r for r in json.load(f)["rows"] if r["axis"] not in a.axes.split(",")]
    for axis in a.axes.split(","):
        points = a.points.split(",") if a.points else GRIDS[a.grid][axis]
        for value in points:
            r = run_point(axis, value, a.threads, a.dtype)
            rows.append(r)
            print(f"{axis:8s} {str(value):>5s}: conveyor {r['conveyor']['tok_per_s']:8.1f} tok/s "
                  f"TPOT {r['conveyor']['tpot_ms']:7.1f} ms | vllm {r['vllm']['tok_per_s']:8.1f} tok/s "
                  f"TPOT {r['vllm']['tpot_ms']:7.1f} ms | ratio {r['ratio']:.2f}x | "
                  f"tokens identical {r['tokens_identical']}", flush=True)
            with open(a.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "threads": a.threads, "dtype": a.dtype, "rows": rows}, f, indent=1)
    plot(rows, a.png)
    print(f"wrote {a.json} and {a.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
