"""EngineConfig: one frozen config, built once from YAML or keyword arguments.

Sections follow DESIGN.md §8. Values measured at start-up (how many KV blocks
fit) live in `engine.core.KVCacheInfo`, never here. Environment variables only
feed defaults, in `_env_defaults`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec

_FROZEN = dict(frozen=True, forbid_unknown_fields=True, kw_only=True)


class ModelConfig(msgspec.Struct, **_FROZEN):
    path: str = ""
    tokenizer: str | None = None  # defaults to path
    dtype: str = "float32"
    max_model_len: int | None = None  # None: from the checkpoint's config.json
    seed: int = 0
    attention_backend: str = "auto"
    max_n: int = 16  # cap on SamplingParams.n


class ParallelConfig(msgspec.Struct, **_FROZEN):
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    executor: str = "uniproc"
    placement_strategy: str = "PACK"
    pp_layer_partition: list[int] | None = None


class SchedulerConfig(msgspec.Struct, **_FROZEN):
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"


class CacheConfig(msgspec.Struct, **_FROZEN):
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None
    cpu_kv_cache_bytes: int = 1 << 30  # KV budget when running on CPU
    enable_prefix_caching: bool = True


class ServeConfig(msgspec.Struct, **_FROZEN):
    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    api_key_env: str | None = None
    max_ongoing_requests: int | None = None  # None: sized from max_num_seqs
    served_model_name: str | None = None
    max_body_bytes: int = 2 * 1024 * 1024
    metrics_public: bool = False
    cors_origins: list[str] = msgspec.field(default_factory=list)


class EngineConfig(msgspec.Struct, **_FROZEN):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    serve: ServeConfig = msgspec.field(default_factory=ServeConfig)

    @property
    def max_model_len(self) -> int:
        assert self.model.max_model_len is not None, "config not resolved"
        return self.model.max_model_len

    @property
    def world_size(self) -> int:
        return self.parallel.tensor_parallel_size * self.parallel.pipeline_parallel_size


class ConfigError(ValueError):
    pass


# Flat LLM(...) keyword -> (section, field).
_KWARG_MAP: dict[str, tuple[str, str]] = {
    "model": ("model", "path"), "tokenizer": ("model", "tokenizer"), "dtype": ("model", "dtype"),
    "max_model_len": ("model", "max_model_len"), "seed": ("model", "seed"),
    "attention_backend": ("model", "attention_backend"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "pipeline_parallel_size": ("parallel", "pipeline_parallel_size"),
    "executor": ("parallel", "executor"),
    "placement_strategy": ("parallel", "placement_strategy"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "enable_chunked_prefill": ("scheduler", "enable_chunked_prefill"),
    "long_prefill_token_threshold": ("scheduler", "long_prefill_token_threshold"),
    "policy": ("scheduler", "policy"),
    "block_size": ("cache", "block_size"), "num_gpu_blocks": ("cache", "num_gpu_blocks"),
    "gpu_memory_utilization": ("cache", "gpu_memory_utilization"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "cpu_kv_cache_bytes": ("cache", "cpu_kv_cache_bytes"),
}


def _env_defaults() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if "CONVEYOR_ATTENTION_BACKEND" in os.environ:
        out.setdefault("model", {})["attention_backend"] = os.environ["CONVEYOR_ATTENTION_BACKEND"]
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _kwargs_to_tree(kwargs: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k not in _KWARG_MAP:
            raise ConfigError(f"unknown engine argument {k!r}; known: {sorted(_KWARG_MAP)}")
        section, field = _KWARG_MAP[k]
        tree.setdefault(section, {})[field] = v
    return tree


def build_config(tree: dict[str, Any] | None = None, source: str = "<kwargs>",
                 **kwargs: Any) -> EngineConfig:
    """Decode, validate and resolve a config tree (+ flat overrides) once."""
    tree = dict(tree or {})
    if isinstance(tree.get("model"), str):
        tree["model"] = {"path": tree["model"]}
    tree = _merge(_merge(_env_defaults(), tree), _kwargs_to_tree(kwargs))
    _default_max_num_seqs(tree)
    try:
        cfg = msgspec.convert(tree, EngineConfig, strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
    _validate(cfg, source)
    return _resolve(cfg, source)


def _default_max_num_seqs(tree: dict[str, Any]) -> None:
    """An unset max_num_seqs follows a small token budget down (as it must be
    <= max_num_batched_tokens); explicitly inconsistent values still fail."""
    sched = tree.get("scheduler")
    if isinstance(sched, dict) and "max_num_seqs" not in sched:
        budget = sched.get("max_num_batched_tokens")
        default = SchedulerConfig().max_num_seqs
        if isinstance(budget, int) and not isinstance(budget, bool) and 1 <= budget < default:
            tree["scheduler"] = {**sched, "max_num_seqs": budget}


def load_config(path: str, **overrides: Any) -> EngineConfig:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    with open(p) as f:
        tree = yaml.safe_load(f) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(tree).__name__}")
    return build_config(tree, source=str(path), **overrides)


def _check(ok: bool, source: str, key: str, expect: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"{source}: `{key}` must be {expect}, got {got!r}")


def _validate(cfg: EngineConfig, source: str) -> None:
    m, p, s, c = cfg.model, cfg.parallel, cfg.scheduler, cfg.cache
    _check(m.dtype in ("float32", "float16", "bfloat16", "auto"), source, "model.dtype",
           "one of float32/float16/bfloat16/auto", m.dtype)
    _check(m.max_model_len is None or m.max_model_len >= 1, source, "model.max_model_len", ">= 1", m.max_model_len)
    _check(m.attention_backend in ("auto", "torch", "triton"), source, "model.attention_backend",
           "one of auto/torch/triton", m.attention_backend)
    _check(m.max_n >= 1, source, "model.max_n", ">= 1", m.max_n)
    _check(p.tensor_parallel_size >= 1, source, "parallel.tensor_parallel_size", ">= 1", p.tensor_parallel_size)
    _check(p.pipeline_parallel_size >= 1, source, "parallel.pipeline_parallel_size", ">= 1", p.pipeline_parallel_size)
    _check(p.executor in ("uniproc", "ray", "mp"), source, "parallel.executor", "one of uniproc/ray/mp", p.executor)
    _check(p.placement_strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"), source,
           "parallel.placement_strategy", "a Ray placement strategy", p.placement_strategy)
    _check(s.max_num_seqs >= 1, source, "scheduler.max_num_seqs", ">= 1", s.max_num_seqs)
    _check(s.max_num_batched_tokens >= 1, source, "scheduler.max_num_batched_tokens", ">= 1", s.max_num_batched_tokens)
    _check(s.long_prefill_token_threshold >= 0, source, "scheduler.long_prefill_token_threshold", ">= 0",
           s.long_prefill_token_threshold)
    _check(s.policy in ("fcfs", "priority"), source, "scheduler.policy", "fcfs or priority", s.policy)
    _check(c.block_size in (8, 16, 32, 64, 128), source, "cache.block_size", "one of 8/16/32/64/128", c.block_size)
    _check(0.0 < c.gpu_memory_utilization <= 1.0, source, "cache.gpu_memory_utilization", "in (0, 1]",
           c.gpu_memory_utilization)
    _check(c.num_gpu_blocks is None or c.num_gpu_blocks >= 2, source, "cache.num_gpu_blocks", ">= 2",
           c.num_gpu_blocks)
    _check(c.cpu_kv_cache_bytes > 0, source, "cache.cpu_kv_cache_bytes", "> 0", c.cpu_kv_cache_bytes)
    _check(1 <= cfg.serve.port <= 65535, source, "serve.port", "in 1..65535", cfg.serve.port)
    _check(cfg.serve.replicas >= 1, source, "serve.replicas", ">= 1", cfg.serve.replicas)


def _resolve(cfg: EngineConfig, source: str) -> EngineConfig:
    m, s = cfg.model, cfg.scheduler
    max_len = m.max_model_len
    if m.path:
        hf_len = _checkpoint_max_len(m.path)
        if max_len is None:
            max_len = hf_len
        elif hf_len is not None and max_len > hf_len:
            raise ConfigError(f"{source}: `model.max_model_len` ({max_len}) exceeds the model's "
                              f"max_position_embeddings ({hf_len})")
    if max_len is None:
        max_len = 2048
    if not s.enable_chunked_prefill and max_len > s.max_num_batched_tokens:
        raise ConfigError(
            f"{source}: with `scheduler.enable_chunked_prefill` false, `scheduler.max_num_batched_tokens` "
            f"({s.max_num_batched_tokens}) must be >= max_model_len ({max_len}), or a long prompt could never run")
    if s.max_num_batched_tokens < s.max_num_seqs:
        raise ConfigError(f"{source}: `scheduler.max_num_batched_tokens` ({s.max_num_batched_tokens}) must be "
                          f">= `scheduler.max_num_seqs` ({s.max_num_seqs})")
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(m, max_model_len=max_len))


def _checkpoint_max_len(path: str) -> int | None:
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    with open(f) as fh:
        hf = json.load(fh)
    text = hf.get("text_config", hf)
    v = text.get("max_position_embeddings")
    return int(v) if isinstance(v, int) else None
