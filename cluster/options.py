"""Command-line options that override engine config keys, shared by the
`conveyor` CLI and `python -m cluster.batch`.

Every option names the config key it overrides in its --help line, and every
override reaches the config as a dotted key path (`scheduler.max_num_seqs`),
which `engine.config.load_config(path, **overrides)` merges over the file
before validation: an override is checked exactly like the file's own value.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

import yaml


@dataclass(frozen=True)
class Override:
    flag: str
    key: str  # dotted config key path
    type: Callable[[str], Any]
    help: str


def _bool(text: str) -> bool:
    v = yaml.safe_load(text)
    if not isinstance(v, bool):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return v


ENGINE_OVERRIDES: tuple[Override, ...] = (
    Override("--model", "model.path", str, "local Hugging Face checkpoint directory"),
    Override("--tokenizer", "model.tokenizer", str, "tokenizer directory (default: the model's)"),
    Override("--dtype", "model.dtype", str, "float32 | float16 | bfloat16 | auto"),
    Override("--max-model-len", "model.max_model_len", int, "context length cap"),
    Override("--seed", "model.seed", int, "engine seed"),
    Override("--attention-backend", "model.attention_backend", str, "auto | torch | triton"),
    Override("--enforce-eager", "model.enforce_eager", _bool,
             "true | false: no CUDA graphs for decode steps"),
    Override("--tensor-parallel-size", "parallel.tensor_parallel_size", int, "TP ranks per engine"),
    Override("--pipeline-parallel-size", "parallel.pipeline_parallel_size", int,
             "PP stages per engine"),
    Override("--executor", "parallel.executor", str, "uniproc | mp | ray"),
    Override("--placement-strategy", "parallel.placement_strategy", str,
             "PACK | SPREAD | STRICT_PACK | STRICT_SPREAD"),
    Override("--max-num-seqs", "scheduler.max_num_seqs", int, "max running requests"),
    Override("--max-num-batched-tokens", "scheduler.max_num_batched_tokens", int,
             "token budget per step"),
    Override("--enable-chunked-prefill", "scheduler.enable_chunked_prefill", _bool, "true | false"),
    Override("--policy", "scheduler.policy", str, "fcfs | priority"),
    Override("--async-scheduling", "scheduler.async_scheduling", str,
             "auto | on | off: plan the next step while one runs"),
    Override("--block-size", "cache.block_size", int, "KV block size in tokens"),
    Override("--num-gpu-blocks", "cache.num_gpu_blocks", int, "KV blocks (default: measured)"),
    Override("--gpu-memory-utilization", "cache.gpu_memory_utilization", float,
             "fraction of GPU memory for the engine"),
    Override("--enable-prefix-caching", "cache.enable_prefix_caching", _bool, "true | false"),
    Override("--speculative-method", "speculative.method", str,
             "ngram: n-gram (prompt-lookup) speculative decoding"),
    Override("--num-speculative-tokens", "speculative.num_speculative_tokens", int,
             "draft tokens per step, 1..8"),
)

SERVE_OVERRIDES: tuple[Override, ...] = (
    Override("--host", "serve.host", str, "HTTP bind address"),
    Override("--port", "serve.port", int, "HTTP port"),
    Override("--replicas", "serve.replicas", int, "Serve replicas (one engine each)"),
    Override("--served-model-name", "serve.served_model_name", str,
             "the `model` name clients send"),
    Override("--api-key-env", "serve.api_key_env", str,
             "environment variable holding the API key"),
)


def _dest(o: Override) -> str:
    return "ov_" + o.key.replace(".", "__")


def add_override_options(parser: argparse.ArgumentParser,
                         overrides: tuple[Override, ...] = ENGINE_OVERRIDES,
                         title: str = "engine config overrides") -> None:
    group = parser.add_argument_group(title)
    for o in overrides:
        metavar = o.flag.lstrip("-").split("-")[-1].upper()
        group.add_argument(o.flag, dest=_dest(o), type=o.type, default=None, metavar=metavar,
                           help=f"{o.help}; overrides {o.key}")


def add_set_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="set_values", action="append", default=[],
                        metavar="KEY.PATH=VALUE",
                        help="override any config key, e.g. --set scheduler.max_num_seqs=64 "
                             "(VALUE is parsed as YAML; repeatable; applied after the options above)")


def parse_set(items: list[str]) -> dict[str, Any]:
    """["scheduler.max_num_seqs=64", "model.path=x"] -> {"scheduler.max_num_seqs": 64, ...}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or "." not in key or not key.replace(".", "").replace("_", "").isalnum():
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. scheduler.max_num_seqs=64")
        try:
            out[key] = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            out[key] = text
    return out


def collect_overrides(args: argparse.Namespace,
                      overrides: tuple[Override, ...] = ENGINE_OVERRIDES) -> dict[str, Any]:
    """Dotted key -> value for every option that was given, then --set."""
    out = {o.key: getattr(args, _dest(o)) for o in overrides
           if getattr(args, _dest(o), None) is not None}
    out.update(parse_set(getattr(args, "set_values", []) or []))
    return out
