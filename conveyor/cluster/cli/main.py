"""The `conveyor` command line: serve, generate, batch, bench and validate configs.

    conveyor serve CONFIG [--port 8001 ...]           OpenAI API on Ray Serve (blocks)
    conveyor generate CONFIG --prompt "Hello" [...]   offline generation, prints the text
    conveyor batch --config CONFIG --input in.jsonl --output out.jsonl
    conveyor bench {scheduler,offline,offline-compare,serve,attention,spec,serve-compare,migration,disagg,peer-fetch} [ARGS...]
    conveyor config validate CONFIG [CONFIG...]
    conveyor drain --url URL --engine I [--undrain]  move a data-parallel engine's requests off it
    conveyor scale --url URL (--engines N | --reload) scale the engines, or roll out the changed config

Every option that changes the engine names the config key it overrides in
--help; `--set KEY.PATH=VALUE` overrides any other key. Overrides are
validated exactly like the file (a bad one fails with the key path).
Exit codes: 0 ok, 1 failed at run time, 2 bad configuration or arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from conveyor.cluster.cli.options import (
    ENGINE_OVERRIDES,
    SERVE_OVERRIDES,
    add_override_options,
    add_set_option,
    collect_overrides,
)
from conveyor.cluster.cli.setup_checks import check_engine_setup, check_serve_setup
from conveyor.engine.config import ConfigError, check_cluster_fits, load_config

ROOT = Path(__file__).resolve().parents[3]  # the checkout (bench/ is not in the wheel)
BENCHES = {"scheduler": "bench/scheduler.py", "offline": "bench/offline_throughput.py",
           "serve": "bench/serve_load.py", "attention": "bench/attention.py",
           "spec": "bench/spec_decode.py", "serve-compare": "bench/serve_compare.py",
           "offline-compare": "bench/compare_vllm.py", "migration": "bench/migration.py",
           "disagg": "bench/disagg.py", "peer-fetch": "bench/peer_fetch.py"}
_FORMATTER = argparse.ArgumentDefaultsHelpFormatter


def _error(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


# ---- serve ----------------------------------------------------------------------------

def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API from an engine config (Ray Serve)",
                       description="Start Ray Serve with one OpenAI-compatible app backed by the "
                                   "config's engine; prints the URL and serves until Ctrl-C.")
    p.add_argument("config", help="engine config YAML")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: $RAY_ADDRESS, else a new local instance)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="worker bundles: GPUs or CPUs (auto: GPUs if the cluster has any)")
    add_override_options(p, SERVE_OVERRIDES, "serve config overrides")
    add_override_options(p)
    add_set_option(p)
    p.set_defaults(func=cmd_serve)


def _wait_for_signal() -> None:
    """Until SIGINT or SIGTERM; a SIGHUP reloads the config (a rollout, conveyor/cluster/serve_app.py)."""
    from conveyor.cluster.serve_app import wait_reloading_on_sighup

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    wait_reloading_on_sighup("conveyor", stop)


def cmd_serve(args: argparse.Namespace) -> int:
    overrides = collect_overrides(args, SERVE_OVERRIDES + ENGINE_OVERRIDES)
    config = load_config(args.config, **overrides)
    import ray
    from ray import serve

    from conveyor.cluster.batch.job import init_ray
    from conveyor.cluster.openai.server import model_name_of
    from conveyor.cluster.serve_app import (
        direct_ingress_urls,
        enable_direct_ingress,
        replica_cpus,
        run_serve,
        wants_direct_ingress,
    )

    per_replica = replica_cpus(config, use_gpu=False)  # CPU bundles; GPUs are checked below
    starts_ray = not (args.address or os.environ.get("RAY_ADDRESS"))
    # Before Ray starts: a key, port or checkpoint mistake is one line, not a failed deploy.
    check_serve_setup(config, args.config, binds_port=starts_ray)
    direct = wants_direct_ingress(config, starts_ray)
    if direct and starts_ray:
        enable_direct_ingress()  # before the local Ray instance starts
    started = init_ray(args.address, local_cpus=int(per_replica * config.serve.replicas) + 2)
    try:
        check_cluster_fits(config, ray.cluster_resources().get("GPU", 0),
                           copies=config.serve.replicas, source=args.config)
        url = run_serve(args.config, blocking=False, overrides=overrides, device=args.device)
        print(f"Serving {model_name_of(config)!r} at {url}/v1 (OpenAI API). Ctrl-C to stop.", flush=True)
        if direct:
            for d_url in direct_ingress_urls("conveyor", config.serve.host):
                print(f"Replica direct ingress (no proxy hop): {d_url}/v1", flush=True)
        _wait_for_signal()
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
    return 0


# ---- generate ----------------------------------------------------------------------------

def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="offline generation with the LLM class; prints the text",
                       description="Load the config's engine in this process (or on Ray workers "
                                   "with executor ray), generate, print each completion.",
                       formatter_class=_FORMATTER)
    p.add_argument("config", help="engine config YAML")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for several prompts)")
    s = p.add_argument_group("sampling parameters (per request; not config keys)")
    s.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--n", type=int, default=1, help="completions per prompt")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message in the model's chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (text, token ids, finish reason)")
    add_override_options(p)
    add_set_option(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from conveyor.engine import LLM, SamplingParams

    overrides = collect_overrides(args)
    config = load_config(args.config, **overrides)  # a config error before any engine work
    check_engine_setup(config, args.config)  # a broken checkpoint: one line, no worker traceback
    try:
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, n=args.n, stop=list(args.stop),
                            ignore_eos=args.ignore_eos, seed=args.sampling_seed)
    except ValueError as e:
        return _error(str(e))
    llm = LLM(config=config)
    try:
        prompts: list[Any] = list(args.prompt)
        if args.chat:
            tok = llm.tokenizer
            if tok is None:
                return _error("--chat needs a tokenizer in the model directory")
            prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                                  add_special_tokens=False) for p in prompts]
        outs = llm.generate(prompts, sp, use_tqdm=False)
    except ValueError as e:
        return _error(str(e))
    finally:
        llm.shutdown()
    for prompt, out in zip(args.prompt, outs):
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": prompt, "index": c.index, "text": c.text,
                                  "token_ids": list(c.token_ids), "finish_reason": c.finish_reason},
                                 ensure_ascii=False))
            else:
                print(c.text)
    return 0


# ---- batch / bench -----------------------------------------------------------------------

def _add_batch(sub: Any) -> None:
    from conveyor.cluster.batch import job as batch

    p = sub.add_parser("batch", help="offline inference over an OpenAI Batch JSONL file (resumable)",
                       description=batch.__doc__.split("\n\n")[0] + " Same as `python -m conveyor.cluster.batch`.")
    batch.add_batch_arguments(p)
    p.set_defaults(func=lambda a: batch.run_from_args(a))


def _add_bench(sub: Any) -> None:
    listing = ", ".join(f"{k} ({v})" for k, v in BENCHES.items())
    p = sub.add_parser("bench", help="run a benchmark script under bench/",
                       description=f"Run one of the benchmark scripts: {listing}. Arguments after "
                                   f"the name go to the script (`conveyor bench offline --help`).")
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    script = ROOT / BENCHES[args.name]
    if not script.is_file():
        return _error(f"{script} not found: `conveyor bench` needs a source checkout", 1)
    return subprocess.call([sys.executable, str(script), *args.args])


# ---- config validate -------------------------------------------------------------------

def _add_config(sub: Any) -> None:
    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_cmd", metavar="{validate}", required=True)
    v = csub.add_parser("validate", help="load engine or Serve config files and report errors",
                        description="Load each file through the config schema (a Serve config: "
                                    "its import_path and each application's engine config). "
                                    "Checkpoints need not exist. Exit 1 if any file is invalid.")
    v.add_argument("configs", nargs="+", metavar="CONFIG", help="YAML files")
    v.add_argument("--gpus", type=float, default=None,
                   help="also check tensor_parallel_size × pipeline_parallel_size fits this many GPUs")
    add_set_option(v)
    v.set_defaults(func=cmd_config_validate)


def serve_app_configs(path: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(application name, engine config path, its overrides) of each app in a
    Serve config file, after checking the structure and importing each
    import_path (the app builder must exist)."""
    import importlib

    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    apps = doc.get("applications") if isinstance(doc, dict) else None
    if not isinstance(apps, list) or not apps:
        raise ConfigError(f"{path}: applications: expected a non-empty list")
    out = []
    for i, app in enumerate(apps):
        where = f"{path}: applications[{i}]"
        if not isinstance(app, dict) or not isinstance(app.get("import_path"), str):
            raise ConfigError(f"{where}.import_path: expected a string module:attribute")
        module, _, attr = app["import_path"].partition(":")
        try:
            getattr(importlib.import_module(module), attr or "app")
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{where}.import_path: cannot import {app['import_path']!r}: {e}") from None
        args = app.get("args") or {}
        if not isinstance(args.get("config"), str):
            raise ConfigError(f"{where}.args.config: expected an engine config path")
        overrides = args.get("overrides") or {}
        if not isinstance(overrides, dict):
            raise ConfigError(f"{where}.args.overrides: expected a mapping of config keys")
        out.append((str(app.get("name", i)), args["config"], overrides))
    return out


def _is_serve_file(path: str) -> bool:
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(doc, dict) and "applications" in doc


def _validate_one(path: str, overrides: dict[str, Any], gpus: float | None) -> str:
    if _is_serve_file(path):
        apps = serve_app_configs(path)
        for _, cfg, app_overrides in apps:
            _validate_one(cfg, {**app_overrides, **overrides}, gpus)
        return f"Serve config; applications: {', '.join(f'{n} -> {c}' for n, c, _ in apps)}"
    cfg = load_config(path, **overrides)
    if gpus is not None:
        check_cluster_fits(cfg, gpus, source=path)
    p = cfg.parallel
    return (f"model {cfg.model.path or '(none)'}, tp={p.tensor_parallel_size} pp={p.pipeline_parallel_size} "
            f"executor={p.executor}, max_model_len={cfg.max_model_len}, dtype={cfg.model.dtype}")


def cmd_config_validate(args: argparse.Namespace) -> int:
    overrides = collect_overrides(args, ())
    bad = 0
    for path in args.configs:
        try:
            print(f"ok    {path}: {_validate_one(path, overrides, args.gpus)}")
        except ConfigError as e:
            bad += 1
            print(f"error {e}")
    return 1 if bad else 0


# ---- drain -----------------------------------------------------------------------------

def _add_drain(sub: Any) -> None:
    p = sub.add_parser("drain", help="move every request off one data-parallel engine of a server",
                       formatter_class=_FORMATTER,
                       description="POST /admin/drain: the engine takes no new request, its in-flight "
                                   "requests continue on the other engines (no stream breaks), and "
                                   "this returns once it holds none. --undrain lets it take requests "
                                   "again. The API key is read from the variable --api-key-env names.")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--engine", type=int, required=True, help="the engine's index (0-based)")
    p.add_argument("--undrain", action="store_true", help="let a drained engine take requests again")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the engine to empty")
    p.add_argument("--api-key-env", default="CONVEYOR_API_KEY", help="environment variable holding the key")
    p.set_defaults(func=cmd_drain)


def cmd_drain(args: argparse.Namespace) -> int:
    body = {"engine": args.engine} if args.undrain else {"engine": args.engine, "timeout_s": args.timeout}
    return _post_admin(args, "/admin/undrain" if args.undrain else "/admin/drain", body)


def _add_scale(sub: Any) -> None:
    p = sub.add_parser("scale", help="add or remove a server's data-parallel engines, or roll out its "
                                     "reloaded config", formatter_class=_FORMATTER,
                       description="--engines N: POST /admin/scale, engines are added or removed (each "
                                   "drained through migration first) until N are up. --reload: POST "
                                   "/admin/reload, the server reads its config file again and replaces "
                                   "its engines one at a time with the changed engine settings (the same "
                                   "as SIGHUP to `conveyor serve`); a changed model is refused. No stream "
                                   "breaks either way.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--engines", type=int, help="the number of engines to have up")
    what.add_argument("--reload", action="store_true", help="roll out the server's changed config file")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each engine to empty")
    p.add_argument("--api-key-env", default="CONVEYOR_API_KEY", help="environment variable holding the key")
    p.set_defaults(func=cmd_scale)


def cmd_scale(args: argparse.Namespace) -> int:
    if args.reload:
        return _post_admin(args, "/admin/reload", {"timeout_s": args.timeout})
    return _post_admin(args, "/admin/scale", {"engines": args.engines, "timeout_s": args.timeout})


def _post_admin(args: argparse.Namespace, path: str, body: dict[str, Any]) -> int:
    """POST body to the server's admin path with the key from --api-key-env; prints the answer."""
    import urllib.error
    import urllib.request

    url = args.url.rstrip("/") + path
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(args.api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=args.timeout + 30) as r:
            print(r.read().decode())
        return 0
    except urllib.error.HTTPError as e:
        return _error(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')}", 1)
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        return _error(f"{url}: {e}", 1)


# ---- main ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor", description=__doc__.split("\n\n")[0],
                                epilog="`conveyor COMMAND --help` lists each command's options and "
                                       "the config keys they override.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_batch(sub)
    _add_bench(sub)
    _add_config(sub)
    _add_drain(sub)
    _add_scale(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        return _error(str(e))
    except ValueError as e:  # a malformed --set
        return _error(str(e))
    except KeyboardInterrupt:
        return 130
