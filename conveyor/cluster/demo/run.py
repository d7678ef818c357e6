"""`make run`: from a fresh clone to an answered request, on CPU, offline.

    .venv/bin/python -m conveyor.cluster.demo [--keep-serving] [--port N] [--prompt TEXT]

1. puts the demo checkpoint in `demo_model/` if missing: a small Llama trained on
   the docstrings of Python's standard library (conveyor/cluster/demo/assets/, made by
   conveyor/cluster/demo/train.py);
2. starts a local Ray instance and serves configs/tiny-cpu.yaml (which points
   at demo_model/) on an OpenAI-compatible endpoint at 127.0.0.1;
3. sends one chat completion request over HTTP and prints the answer and URL;
4. shuts everything down (or keeps serving with --keep-serving, until Ctrl-C).

The model is tiny and was trained for minutes: it answers in sentences in the
style of Python's documentation, not with facts. Nothing is downloaded. If the configured port is taken, a free one is used.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

from conveyor.parallel.ports import free_port, port_free

# The package's copy of configs/tiny-cpu.yaml (a link in the checkout, a file in the wheel),
# so the demo runs from an installed wheel as from a clone.
DEFAULT_CONFIG = str(Path(__file__).resolve().with_name("tiny-cpu.yaml"))


def ask(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One POST /v1/chat/completions, stdlib only (no client library needed)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m conveyor.cluster.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="engine config to serve")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's serve.port)")
    p.add_argument("--prompt", default="What does json.dumps do?")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--keep-serving", action="store_true", help="keep serving after the demo request")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from conveyor.cluster.demo.model import ensure_demo_model
    from conveyor.engine.config import load_config

    # Relative paths are relative to the working directory (the repo root under `make run`).
    config_path = os.path.abspath(args.config)
    config = load_config(config_path)
    model_dir = os.path.abspath(config.model.path)
    if ensure_demo_model(model_dir):
        print(f"built the demo checkpoint in {model_dir}", flush=True)
    host = config.serve.host
    port = args.port or config.serve.port
    if not port_free(host, port):
        new = free_port(host)
        print(f"port {port} is in use; serving on {new} instead", flush=True)
        port = new

    import ray
    from ray import serve

    from conveyor.cluster.openai.server import model_name_of
    from conveyor.cluster.serve_app import run_serve

    t0 = time.monotonic()
    # The replica's placement group takes 2 logical CPUs (replica + engine actor):
    # declare at least that many, so a 1-core machine does not wait forever.
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             num_cpus=max(os.cpu_count() or 1, 2))
    try:
        url = run_serve(config_path, blocking=False,
                        overrides={"model.path": model_dir, "serve.port": port})
        name = model_name_of(config)
        print(f"serving {name!r} at {url}/v1 (ready in {time.monotonic() - t0:.0f}s)", flush=True)
        reply = ask(url, name, args.prompt, args.max_tokens)
        answer = reply["choices"][0]["message"]["content"]
        print(f"\nPOST {url}/v1/chat/completions\n  user:      {args.prompt}\n"
              f"  assistant: {answer!r}\n  usage:     {reply['usage']}\n"
              "(a 2M-parameter model trained on Python's docstrings: sentences, not facts; "
              "point configs/tiny-cpu.yaml at a real checkpoint for real answers)", flush=True)
        if args.keep_serving:
            print(f"\nstill serving at {url}/v1 - try:\n  curl {url}/v1/models\nCtrl-C to stop.", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    print("shut down.")
    return 0
