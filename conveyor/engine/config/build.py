"""Building the one frozen EngineConfig from YAML or keyword arguments.

Values measured at start-up (how many KV blocks fit) live in
`conveyor.engine.core.engine_core.KVCacheInfo`, never here. Environment variables only feed
defaults, in `_env_defaults`.

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

from conveyor.engine.config.knobs import KnobInfo, knob_table
from conveyor.engine.config.sections import TRITON_BLOCK_SIZES, EngineConfig, SchedulerConfig


class ConfigError(ValueError):
    pass


# LLM(...) keywords that carry a whole section.
_SECTION_KWARGS: dict[str, str] = {"speculative_config": "speculative"}


def _env_defaults() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if "CONVEYOR_ATTENTION_BACKEND" in os.environ:
        out.setdefault("model", {})["attention_backend"] = os.environ["CONVEYOR_ATTENTION_BACKEND"]
    if "CONVEYOR_CPU_ISA" in os.environ:
        out.setdefault("model", {})["cpu_isa"] = os.environ["CONVEYOR_CPU_ISA"]
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
    return _resolve(_map_legacy_keys(cfg, source, over), source, over)


def _map_legacy_keys(cfg: EngineConfig, source: str, over: dict[str, Any]) -> EngineConfig:
    """serve.engine_actor is the older spelling of parallel.engine_actor: it
    sets the knob when that is unset (with executor "ray" the core was always
    in an actor, so there it changes nothing), and is cleared so nothing else
    reads it."""
    legacy, p = cfg.serve.engine_actor, cfg.parallel
    if legacy is None:
        return cfg
    if p.engine_actor is not None and p.engine_actor != legacy:
        raise _fail(source, "serve.engine_actor", f"unset or equal to parallel.engine_actor "
                    f"({str(p.engine_actor).lower()}), its newer spelling", legacy, over)
    par = p if p.executor == "ray" else msgspec.structs.replace(p, engine_actor=legacy)
    return msgspec.structs.replace(cfg, parallel=par,
                                   serve=msgspec.structs.replace(cfg.serve, engine_actor=None))


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
            tree = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).replace("\n", " ")
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if tree is None:  # an empty file (or only comments) is a mistake, not "all defaults"
        raise ConfigError(f"{path}: the file is empty: write at least `model: {{path: CHECKPOINT_DIR}}`")
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


# ---- value checks (derived from the fields' knobs: type errors and range errors read the same)

_KNOBS = knob_table(EngineConfig)
_RULES: dict[str, tuple[str, Callable[[Any], bool]]] = {k: (i.knob.expect, i.knob.ok) for k, i in _KNOBS.items()}
# Flat LLM(...) keyword -> (section, field).
_KWARG_MAP: dict[str, tuple[str, str]] = {
    i.kwarg: (k.split(".")[0], k.split(".")[1]) for k, i in _KNOBS.items() if i.kwarg}


def cli_knobs() -> list[KnobInfo]:
    """The knobs with a CLI flag, in declaration order (conveyor/cluster/cli/options.py builds its options from them)."""
    return [i for i in _KNOBS.values() if i.flag]


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
    if cfg.scheduler.async_scheduling in ("on", True) and cfg.parallel.pipeline_parallel_size > 1:
        raise _fail(source, "scheduler.async_scheduling",
                    "auto or off with parallel.pipeline_parallel_size > 1 (the batch queue already "
                    "overlaps steps there)", cfg.scheduler.async_scheduling, over)
    _validate_lora(cfg, source, over)
    _validate_scaling(cfg, source, over)
    _validate_kv_tiers(cfg, source, over)
    _validate_disaggregation(cfg, source, over)


def _validate_disaggregation(cfg: EngineConfig, source: str, over: dict[str, Any]) -> None:
    """P/D: at least one engine of each role, a shared KV folder, fixed roles."""
    p, cc, sv = cfg.parallel, cfg.cache, cfg.serve
    if cc.peer_fetch and not (cc.offload_disk_path and cc.offload_disk_gb > 0 and cc.enable_prefix_caching):
        raise _fail(source, "cache.peer_fetch", "false without a shared KV folder (cache.offload_disk_path "
                    "with cache.offload_disk_gb > 0, and prefix caching): engines pull prefixes through it",
                    cc.peer_fetch, over)
    if p.prefill_engines == 0:
        return
    if p.prefill_engines >= p.data_parallel_size:
        raise _fail(source, "parallel.prefill_engines", f"0, or an int < parallel.data_parallel_size "
                    f"({p.data_parallel_size}): at least one engine must decode", p.prefill_engines, over)
    if not (cc.offload_disk_path and cc.offload_disk_gb > 0):
        raise _fail(source, "cache.offload_disk_path", "a directory every engine shares (with "
                    "cache.offload_disk_gb > 0) when parallel.prefill_engines > 0: prefill engines hand "
                    "the KV over through it (tmpfs such as /dev/shm on one host)", cc.offload_disk_path, over)
    if (sv.max_engines or p.data_parallel_size) != (sv.min_engines or p.data_parallel_size):
        raise _fail(source, "serve.max_engines", "serve.min_engines with parallel.prefill_engines > 0 "
                    "(engine roles are fixed: P/D does not autoscale)", sv.max_engines, over)


def _validate_kv_tiers(cfg: EngineConfig, source: str, over: dict[str, Any]) -> None:
    cc = cfg.cache
    if cc.offload_disk_gb > 0 and not cc.offload_disk_path:
        raise _fail(source, "cache.offload_disk_path", "a directory when cache.offload_disk_gb > 0",
                    cc.offload_disk_path, over)
    if cc.offload_cpu_gb == 0 and cc.offload_disk_gb == 0:
        return
    if not cc.enable_prefix_caching:
        raise _fail(source, "cache.enable_prefix_caching", "true with a KV tier (tiers are keyed by "
                    "the prefix cache's block hashes)", cc.enable_prefix_caching, over)


def _validate_scaling(cfg: EngineConfig, source: str, over: dict[str, Any]) -> None:
    """serve.min_engines <= parallel.data_parallel_size <= serve.max_engines;
    engines scale behind the data-parallel router of one frontend only."""
    sv, dp = cfg.serve, cfg.parallel.data_parallel_size
    lo = dp if sv.min_engines is None else sv.min_engines
    hi = dp if sv.max_engines is None else sv.max_engines
    if lo > dp:
        raise _fail(source, "serve.min_engines", f"null or an int <= parallel.data_parallel_size ({dp}), "
                    "the engines it starts with", sv.min_engines, over)
    if hi < dp:
        raise _fail(source, "serve.max_engines", f"null or an int >= parallel.data_parallel_size ({dp}), "
                    "the engines it starts with", sv.max_engines, over)
    if hi > lo and dp < 2:
        raise _fail(source, "parallel.data_parallel_size", "an int >= 2 when serve.max_engines > "
                    "serve.min_engines (autoscaling runs behind the data-parallel router; it may scale "
                    "down to min_engines)", dp, over)
    if hi > lo and sv.replicas > 1:
        raise _fail(source, "serve.replicas", "1 when serve.max_engines > serve.min_engines (the "
                    "engines of several ingress replicas belong to a shared pool, which does not scale)",
                    sv.replicas, over)


def _validate_lora(cfg: EngineConfig, source: str, over: dict[str, Any]) -> None:
    lc = cfg.lora
    if lc.max_cpu_loras is not None and lc.max_cpu_loras < lc.max_loras:
        raise _fail(source, "lora.max_cpu_loras", f"null or an int >= lora.max_loras ({lc.max_loras})",
                    lc.max_cpu_loras, over)
    if lc.adapters and not lc.enable:
        raise _fail(source, "lora.enable", "true when lora.adapters are listed", lc.enable, over)
    bad = [n for n in lc.adapters if not n or ":" in n]
    if bad:
        raise _fail(source, "lora.adapters", "adapter names that are non-empty and have no ':'",
                    bad[0], over)


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
    p = cfg.parallel
    copies *= p.data_parallel_size
    need = cfg.world_size * copies
    if num_gpus <= 0 or need <= num_gpus:
        return
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
