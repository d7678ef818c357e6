"""What a reloaded config changes, and whether a running server can take it
(DataParallelClient.reload, conveyor/engine/dp/scaling.py).

A reload keeps the model and the frontend: it rolls the engines over to the
new engine settings one at a time (scheduler, cache, parallel layout,
speculative decoding, structured-output compiles), migrating each engine's
requests, and applies changed autoscaling knobs at once. Everything the
frontend or the HTTP server was built from (the model section, LoRA, the
other serve knobs, the starting engine count) is refused with the keys that
changed: those need a new deployment.
"""
from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.config import EngineConfig

# Applied to the autoscaler at once, no engine replaced.
SCALE_KEYS = frozenset({"serve.min_engines", "serve.max_engines", "serve.autoscale_signal",
                        "serve.target_waiting_per_engine", "serve.target_kv_usage", "serve.upscale_delay_s",
                        "serve.downscale_delay_s", "serve.autoscale_interval_s"})
# Rolled out engine by engine.
ENGINE_SECTIONS = frozenset({"scheduler", "cache", "parallel", "speculative", "structured_outputs"})
FIXED_KEYS = frozenset({"parallel.data_parallel_size", "parallel.engine_actor"})


@dataclass(frozen=True)
class ReloadPlan:
    engine_keys: tuple[str, ...]  # rolled out: every engine replaced
    scale_keys: tuple[str, ...]  # the autoscaler's settings

    @property
    def keys(self) -> tuple[str, ...]:
        return self.engine_keys + self.scale_keys


def changed_keys(old: EngineConfig, new: EngineConfig) -> list[str]:
    """Dotted keys ("scheduler.max_num_seqs") whose values differ."""
    out: list[str] = []
    for section in old.__struct_fields__:
        a, b = getattr(old, section), getattr(new, section)
        if a != b:
            out += [f"{section}.{f}" for f in a.__struct_fields__ if getattr(a, f) != getattr(b, f)]
    return out


def plan_reload(old: EngineConfig, new: EngineConfig) -> ReloadPlan:
    """Split the changes into a rollout and autoscaler settings; ValueError
    naming the keys when one of them needs a new deployment."""
    keys = changed_keys(old, new)
    model = [k for k in keys if k.startswith("model.")]
    if model:
        raise ValueError(f"the model changed ({', '.join(model)}): a reload rolls out engine settings for "
                         "the same model; deploy a new application for another model")
    fixed = [k for k in keys if k not in SCALE_KEYS
             and (k in FIXED_KEYS or k.split(".")[0] not in ENGINE_SECTIONS)]
    if fixed:
        raise ValueError(f"{', '.join(fixed)} cannot change on a reload (the frontend was built with "
                         "them): restart the server; a reload changes engine settings (scheduler, cache, "
                         "parallel, speculative, structured_outputs) and the autoscaling knobs")
    return ReloadPlan(tuple(k for k in keys if k not in SCALE_KEYS), tuple(k for k in keys if k in SCALE_KEYS))
