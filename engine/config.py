"""EngineConfig: one frozen config, built once from YAML or keyword arguments.

Sections follow DESIGN.md §8. Values measured at start-up (how many KV blocks
fit) live in `engine.core.KVCacheInfo`, never here. Environment variables only
feed defaults, in `_env_defaults`.

Every mistake fails at load time as a ConfigError in one style:
`FILE: KEY.PATH: expected WHAT, got VALUE` (unknown keys, wrong types, values
out of range, inconsistent combinations). Loading never needs the checkpoint:
a model directory that is not there (yet) only skips the checks that read it.
"""
from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Callable
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
    # Every wait on a worker is bounded: a step with no reply after this long
    # means a wedged rank, and the engine fails as if that rank had died.
    step_timeout_s: float = 120.0
    # Added to the first step's bound (lazy compiles, first CUDA allocations).
    first_step_extra_s: float = 300.0
    # torch.distributed timeout of every collective and PP send/recv.
    collective_timeout_s: float = 300.0
    # How long the Ray executor waits for its placement group; raise it on an
    # autoscaling cluster, where new nodes take minutes to join.
    placement_timeout_s: float = 10.0
    # Logical CPUs a worker's bundle reserves on a CPU-only cluster: below 1,
    # several ranks share a core (tests, laptops).
    num_cpus_per_worker: float = 1.0
    # Recovery from a lost rank (executors mp and ray): the engine rebuilds
    # its worker group and recomputes every in-flight request, at most
    # max_restarts times per restart_window_s; a rebuild that finds no
    # capacity within recovery_timeout_s fails the engine as before.
    max_restarts: int = 3
    restart_window_s: float = 600.0
    recovery_timeout_s: float = 120.0


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
    # A replica admits max_ongoing_requests (None: 2 x max_num_seqs) +
    # max_queued_requests (None: 4 x max_ongoing_requests) requests, all queued
    # in its engine; past that it answers 429 + Retry-After.
    max_queued_requests: int | None = None
    # SSE: send a choice's tokens once this many are pending (vLLM's
    # --stream-interval); the first token and the finish always go at once.
    stream_interval: int = 1
    # SSE: after a prompt's first delta, at most one event per this many ms;
    # tokens that arrive in between go out together (Ray Serve LLM's
    # stream_batching_interval_ms). A model slower than this per token is
    # never delayed; a faster one stops paying HTTP work per token.
    stream_batching_interval_ms: float = 0.0
    # Serve replicas run EngineCore (and, for executors other than "ray", the
    # model) in their own Ray actor, so the HTTP event loop and the engine step
    # never share a GIL. Executor "ray" always does; AsyncLLM(config) outside
    # Serve keeps the core in a thread of its own process.
    engine_actor: bool = True
    # Ray Serve's direct ingress (experimental in Ray 2.60): each replica also
    # serves the API on its own port (30000+), and clients there skip the
    # proxy hop. Every Ray process needs RAY_SERVE_ENABLE_DIRECT_INGRESS=1,
    # which only a process that starts Ray can set. None (the default): on
    # where Conveyor starts Ray itself (`conveyor serve`, run_serve without a
    # running Ray), off on an existing cluster; true/false: always / never.
    direct_ingress: bool | None = None
    # CPU replicas (engine_actor, executor not "ray", no GPU): the last this
    # many cores of the node run the replica's threads (HTTP, Serve, output
    # processing), the others the engine's step thread, as vLLM's CPU backend
    # reserves a core for its frontend (cluster/cpu_layout.py). 0: no pinning.
    # None (the default): 1 for a single CPU replica, else 0.
    frontend_cpus: int | None = None
    # How "auto" tool_choice finds calls in generated text, and the format
    # "required"/named tool_choice constrain output to (cluster/tool_parsers/):
    # hermes (<tool_call>{...}</tool_call>, Qwen) or llama3_json (bare JSON).
    tool_call_parser: str = "hermes"
    # Whether the `priority` request field (policy "priority") is honoured:
    # off by default, so one client cannot jump every other client's queue.
    # Off, a request that sends a non-default priority gets 400.
    allow_client_priority: bool = False
    # Stored /v1/responses (store: true): a sqlite file in this directory
    # behind one named Ray actor (None: <tmpdir>/conveyor-responses), at most
    # responses_max_entries of them (oldest dropped), each kept responses_ttl_s.
    responses_store_dir: str | None = None
    responses_max_entries: int = 10000
    responses_ttl_s: float = 86400.0


class StructuredOutputsConfig(msgspec.Struct, **_FROZEN):
    backend: str = "llguidance"
    compile_threads: int = 1  # grammar compiles run here, never on the step loop
    # JSON schemas (response_format, structured_outputs.json, tool parameters):
    # false (default, xgrammar's strict mode) = an object declaring properties
    # without additionalProperties admits no other keys; true = JSON Schema's
    # open default (engine/structured_output/schema.py).
    allow_additional_properties: bool = False


class SpeculativeConfig(msgspec.Struct, **_FROZEN):
    """N-gram (prompt-lookup) speculative decoding; method None = off.
    Drafts: the k tokens that followed the longest earlier occurrence (length
    prompt_lookup_max down to prompt_lookup_min) of the sequence's suffix."""
    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    @property
    def enabled(self) -> bool:
        return self.method is not None


class EngineConfig(msgspec.Struct, **_FROZEN):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    serve: ServeConfig = msgspec.field(default_factory=ServeConfig)
    structured_outputs: StructuredOutputsConfig = msgspec.field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)

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


# LLM(...) keywords that carry a whole section.
_SECTION_KWARGS: dict[str, str] = {"speculative_config": "speculative"}


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
    """Flat LLM(...) keywords, or dotted key paths (`{"serve.port": 8001}`,
    what `--set serve.port=8001` becomes) -> a tree to merge over the file's."""
    tree: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k in _SECTION_KWARGS:  # a whole section as a mapping (vLLM's speculative_config)
            tree[_SECTION_KWARGS[k]] = v if v is not None else {}
            continue
        if "." in k:
            *parents, leaf = k.split(".")
        elif k in _KWARG_MAP:
            parents, leaf = [_KWARG_MAP[k][0]], _KWARG_MAP[k][1]
        else:
            raise ConfigError(f"unknown engine argument {k!r}; known: {sorted([*_KWARG_MAP, *_SECTION_KWARGS])} "
                              f"or a dotted key path such as 'scheduler.max_num_seqs'")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def build_config(tree: dict[str, Any] | None = None, source: str = "<kwargs>",
                 **kwargs: Any) -> EngineConfig:
    """Decode, validate and resolve a config tree (+ flat or dotted overrides) once."""
    tree = dict(tree or {})
    if isinstance(tree.get("model"), str):
        tree["model"] = {"path": tree["model"]}
    over = _kwargs_to_tree(kwargs)
    tree = _merge(_merge(_env_defaults(), tree), over)
    _default_max_num_seqs(tree)
    try:
        cfg = msgspec.convert(tree, EngineConfig, strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(_format_validation_error(str(e), tree, over, source)) from None
    _validate(cfg, source, over)
    return _resolve(cfg, source, over)


def _default_max_num_seqs(tree: dict[str, Any]) -> None:
    """An unset max_num_seqs follows a small token budget down (as it must be
    <= max_num_batched_tokens); explicitly inconsistent values still fail."""
    sched = tree.get("scheduler")
    if isinstance(sched, dict) and "max_num_seqs" not in sched:
        budget = sched.get("max_num_batched_tokens")
        default = SchedulerConfig().max_num_seqs
        if isinstance(budget, int) and not isinstance(budget, bool) and 1 <= budget < default:
            tree["scheduler"] = {**sched, "max_num_seqs": budget}


def read_config_tree(path: str) -> dict[str, Any]:
    """The raw YAML mapping of an engine config file (no validation)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(p) as f:
            tree = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).replace("\n", " ")
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level: expected a mapping of sections, got {type(tree).__name__}")
    return tree


def load_config(path: str, **overrides: Any) -> EngineConfig:
    """overrides: flat LLM(...) keywords or dotted key paths (`**{"serve.port": 8001}`)."""
    return build_config(read_config_tree(path), source=str(path), **overrides)


# ---- error messages ------------------------------------------------------------------

def _show(value: Any) -> str:
    """A value as the user wrote it (JSON spelling: "ten", true, null)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def _fail(source: str, key: str, expect: str, got: Any, over: dict[str, Any] | None = None) -> ConfigError:
    mark = " (from an override)" if over and _lookup(over, key) is not _MISSING else ""
    return ConfigError(f"{source}: {key}: expected {expect}, got {_show(got)}{mark}")


_MISSING = object()


def _lookup(tree: Any, path: str) -> Any:
    node = tree
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            i = int(part[1:-1])
            node = node[i] if isinstance(node, list) and i < len(node) else _MISSING
        else:
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is _MISSING:
            return _MISSING
    return node


def _section_fields(path: str) -> list[str]:
    """The keys allowed at `path` ("" = the top level, "scheduler", ...)."""
    cls: Any = EngineConfig
    for part in filter(None, path.split(".")):
        f = next((f for f in msgspec.structs.fields(cls) if f.name == part), None)
        if f is None or not (isinstance(f.type, type) and issubclass(f.type, msgspec.Struct)):
            return []
        cls = f.type
    return [f.name for f in msgspec.structs.fields(cls)]


_MSGSPEC_ERR = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _format_validation_error(err: str, tree: dict[str, Any], over: dict[str, Any],
                             source: str) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.scheduler.max_num_seqs`"
    -> "SOURCE: scheduler.max_num_seqs: expected int >= 1, got "ten"". """
    m = _MSGSPEC_ERR.match(err)
    msg, path = (m.group("msg"), (m.group("path") or "").lstrip(".")) if m else (err, "")
    unknown = re.match(r"Object contains unknown field `(?P<f>[^`]*)`", msg)
    if unknown:
        key = f"{path}.{unknown.group('f')}" if path else unknown.group("f")
        known = _section_fields(path)
        near = difflib.get_close_matches(unknown.group("f"), known, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        text = f"{source}: {key}: unknown key{hint}; expected one of {', '.join(known)}"
    else:
        key = path
        expected = re.match(r"Expected `(?P<t>[^`]*)`", msg)
        rule = _RULES.get(re.sub(r"\[\d+\]", "", path))
        want = rule[0] if rule else (expected.group("t").replace(" | ", " or ") if expected else msg)
        want = {"object": "a mapping", "array": "a list"}.get(want, want)
        got = _lookup(tree, path)
        text = (f"{source}: {path or 'top level'}: expected {want}, got "
                f"{_show(got) if got is not _MISSING else msg}")
    from_override = key and _lookup(over, key.split("[")[0]) is not _MISSING
    return text + (" (from an override)" if from_override else "")


# ---- value checks (one table: type errors and range errors read the same) ---------------

_DTYPES = ("float32", "float16", "bfloat16", "auto")
_BACKENDS = ("auto", "torch", "cpu", "triton")
_EXECUTORS = ("uniproc", "ray", "mp")
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_BLOCK_SIZES = (8, 16, 32, 64, 128)
_TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # == cluster.tool_parsers.TOOL_PARSERS (a test checks)
# The Triton kernels' tile shapes (kernels/paged_attention.py asserts the same
# set; a test keeps the two in step).
TRITON_BLOCK_SIZES = (16, 32, 64)


def _one_of(choices: tuple[Any, ...]) -> tuple[str, Callable[[Any], bool]]:
    return f"one of {'/'.join(map(str, choices))}", lambda v: v in choices


def _at_least(lo: int, typ: str = "int", nullable: bool = False) -> tuple[str, Callable[[Any], bool]]:
    text = f"{typ} >= {lo}" + (" or null" if nullable else "")
    return text, lambda v: (v is None and nullable) or (v is not None and v >= lo)


def _finite_in(lo: float, hi: float) -> tuple[str, Callable[[Any], bool]]:
    # NaN fails both comparisons, so it is rejected with everything else.
    return f"float in [{lo:g}, {hi:g}]", lambda v: lo <= v <= hi


_RULES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "model.path": ("a string (a local checkpoint directory)", lambda v: True),
    "model.dtype": _one_of(_DTYPES),
    "model.max_model_len": _at_least(1, nullable=True),
    "model.seed": ("int", lambda v: True),
    "model.attention_backend": _one_of(_BACKENDS),
    "model.max_n": _at_least(1),
    "parallel.tensor_parallel_size": _at_least(1),
    "parallel.pipeline_parallel_size": _at_least(1),
    "parallel.executor": _one_of(_EXECUTORS),
    "parallel.placement_strategy": _one_of(_STRATEGIES),
    "parallel.pp_layer_partition": ("null or a list of ints >= 1, one per pipeline stage",
                                    lambda v: v is None or all(x >= 1 for x in v)),
    "parallel.step_timeout_s": _finite_in(1.0, 86400.0),
    "parallel.first_step_extra_s": _finite_in(0.0, 86400.0),
    "parallel.collective_timeout_s": _finite_in(1.0, 86400.0),
    "parallel.placement_timeout_s": _finite_in(0.1, 86400.0),
    "parallel.num_cpus_per_worker": ("float in (0, 64]", lambda v: 0.0 < v <= 64.0),
    "parallel.max_restarts": ("int in 0..100", lambda v: 0 <= v <= 100),
    "parallel.restart_window_s": _finite_in(1.0, 86400.0),
    "parallel.recovery_timeout_s": _finite_in(1.0, 86400.0),
    "scheduler.max_num_seqs": _at_least(1),
    "scheduler.max_num_batched_tokens": _at_least(1),
    "scheduler.enable_chunked_prefill": ("bool", lambda v: True),
    "scheduler.long_prefill_token_threshold": _at_least(0),
    "scheduler.policy": _one_of(("fcfs", "priority")),
    "cache.block_size": _one_of(_BLOCK_SIZES),
    "cache.gpu_memory_utilization": ("float in (0, 1]", lambda v: 0.0 < v <= 1.0),
    "cache.num_gpu_blocks": _at_least(2, nullable=True),
    "cache.cpu_kv_cache_bytes": _at_least(1),
    "cache.enable_prefix_caching": ("bool", lambda v: True),
    "serve.host": ("a host name or IP address", lambda v: bool(v)),
    "serve.port": ("int in 1..65535", lambda v: 1 <= v <= 65535),
    "serve.replicas": _at_least(1),
    "serve.max_ongoing_requests": _at_least(1, nullable=True),
    "serve.max_body_bytes": _at_least(1),
    "serve.max_queued_requests": _at_least(1, nullable=True),
    "serve.stream_interval": _at_least(1),
    "serve.stream_batching_interval_ms": ("float in [0, 10000]", lambda v: 0.0 <= v <= 10000.0),
    "serve.engine_actor": ("bool", lambda v: True),
    "serve.direct_ingress": ("true, false or null (auto)", lambda v: True),
    "serve.frontend_cpus": ("null (auto) or an int in 0..64",
                            lambda v: v is None or 0 <= v <= 64),
    "serve.tool_call_parser": _one_of(_TOOL_CALL_PARSERS),
    "serve.allow_client_priority": ("bool", lambda v: True),
    "serve.responses_max_entries": ("int in 1..10000000", lambda v: 1 <= v <= 10_000_000),
    "serve.responses_ttl_s": _finite_in(1.0, 365 * 86400.0),
    "structured_outputs.backend": _one_of(("llguidance",)),
    "structured_outputs.compile_threads": ("int in 1..64", lambda v: 1 <= v <= 64),
    "structured_outputs.allow_additional_properties": ("bool", lambda v: True),
    "speculative.method": ("null or ngram", lambda v: v in (None, "ngram")),
    "speculative.num_speculative_tokens": ("int in 1..8", lambda v: 1 <= v <= 8),
    "speculative.prompt_lookup_min": ("int in 1..16", lambda v: 1 <= v <= 16),
    "speculative.prompt_lookup_max": ("int in 1..16", lambda v: 1 <= v <= 16),
}


def _get(cfg: EngineConfig, key: str) -> Any:
    section, field = key.split(".")
    return getattr(getattr(cfg, section), field)


def _validate(cfg: EngineConfig, source: str, over: dict[str, Any]) -> None:
    for key, (expect, ok) in _RULES.items():
        value = _get(cfg, key)
        if not ok(value):
            raise _fail(source, key, expect, value, over)
    p = cfg.parallel
    if p.pp_layer_partition is not None and len(p.pp_layer_partition) != p.pipeline_parallel_size:
        raise _fail(source, "parallel.pp_layer_partition",
                    f"a list of parallel.pipeline_parallel_size ({p.pipeline_parallel_size}) layer counts",
                    p.pp_layer_partition, over)
    if cfg.model.attention_backend not in ("torch", "cpu") and cfg.cache.block_size not in TRITON_BLOCK_SIZES:
        raise _fail(source, "cache.block_size",
                    f"one of {'/'.join(map(str, TRITON_BLOCK_SIZES))} with model.attention_backend "
                    f"{cfg.model.attention_backend!r} (the Triton kernels' tiles; 'auto' is Triton on "
                    f"CUDA); other block sizes need attention_backend 'torch' or 'cpu'", cfg.cache.block_size, over)
    _validate_speculative(cfg, source, over)


def _validate_speculative(cfg: EngineConfig, source: str, over: dict[str, Any]) -> None:
    sp = cfg.speculative
    if not sp.enabled:
        return
    if sp.prompt_lookup_max < sp.prompt_lookup_min:
        raise _fail(source, "speculative.prompt_lookup_max",
                    f"int >= speculative.prompt_lookup_min ({sp.prompt_lookup_min})",
                    sp.prompt_lookup_max, over)
    if cfg.parallel.pipeline_parallel_size > 1:
        # The batch queue keeps several steps in flight, so a step's drafts
        # would be proposed before the previous step's tokens are known.
        raise _fail(source, "parallel.pipeline_parallel_size",
                    "1 when speculative decoding is on (speculation with pipeline parallelism "
                    "is not supported; remove the speculative section or use tensor parallelism)",
                    cfg.parallel.pipeline_parallel_size, over)


def _resolve(cfg: EngineConfig, source: str, over: dict[str, Any]) -> EngineConfig:
    """Fill max_model_len (from the checkpoint when it is there) and check the
    combinations that depend on it."""
    m, s = cfg.model, cfg.scheduler
    max_len = m.max_model_len
    hf_len = _checkpoint_max_len(m.path, source) if m.path else None
    if max_len is None:
        max_len = hf_len if hf_len is not None else 2048
    elif hf_len is not None and max_len > hf_len:
        raise _fail(source, "model.max_model_len",
                    f"int <= the checkpoint's max_position_embeddings ({hf_len})", max_len, over)
    if s.max_num_batched_tokens < s.max_num_seqs:
        raise _fail(source, "scheduler.max_num_batched_tokens",
                    f"int >= scheduler.max_num_seqs ({s.max_num_seqs})", s.max_num_batched_tokens, over)
    if not s.enable_chunked_prefill and max_len > s.max_num_batched_tokens:
        raise _fail(source, "scheduler.max_num_batched_tokens",
                    f"int >= max_model_len ({max_len}) when scheduler.enable_chunked_prefill is false "
                    f"(a longer prompt could never be scheduled)", s.max_num_batched_tokens, over)
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(m, max_model_len=max_len))


def _checkpoint_max_len(path: str, source: str) -> int | None:
    """max_position_embeddings from config.json; None when the directory is
    not there (a config may name a checkpoint that is not downloaded yet)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    try:
        with open(f) as fh:
            hf = json.load(fh)
    except ValueError as e:
        raise ConfigError(f"{source}: model.path: expected a checkpoint with a valid config.json, "
                          f"got {_show(path)} ({f}: {e})") from None
    text = hf.get("text_config", hf) if isinstance(hf, dict) else {}
    v = text.get("max_position_embeddings")
    return int(v) if isinstance(v, int) else None


def check_cluster_fits(cfg: EngineConfig, num_gpus: float, *, copies: int = 1,
                       source: str = "<config>") -> None:
    """Fail when `copies` engines of this config cannot be placed on a cluster
    with `num_gpus` GPUs (call it with `ray.cluster_resources().get("GPU", 0)`).
    0 GPUs means a CPU cluster: workers then take CPU bundles, and Ray's
    placement-group timeout reports a shortage instead."""
    need = cfg.world_size * copies
    if num_gpus <= 0 or need <= num_gpus:
        return
    p = cfg.parallel
    dp = f" × {copies} data-parallel engines" if copies > 1 else ""
    raise ConfigError(f"{source}: parallel: expected at most the cluster's {num_gpus:g} GPUs, got "
                      f"tensor_parallel_size × pipeline_parallel_size = {p.tensor_parallel_size} × "
                      f"{p.pipeline_parallel_size}{dp} = {need}")


def check_model_dir(cfg: EngineConfig, source: str = "<config>") -> None:
    """Fail when the checkpoint (or tokenizer) directory is not there. Call it
    where an engine is about to load the model: loading a config alone never
    needs the checkpoint (shipped configs name placeholder paths)."""
    m = cfg.model
    for key, path in (("model.path", m.path), ("model.tokenizer", m.tokenizer)):
        if path and not os.path.isdir(path):
            raise ConfigError(
                f"{source}: {key}: directory {path} not found (run `make run` to build demo_model, "
                f"or point {key} at a Hugging Face checkpoint directory)")
