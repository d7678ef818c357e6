"""Build a model and fill it from a local HF safetensors checkpoint.

One loading path for every family and parallel layout: each checkpoint tensor
is opened lazily (`get_slice`) and handed to its Parameter's `weight_loader`,
which reads only this rank's slice. Tensors of layers held by other PP stages
(under a PPMissingLayer) are skipped without being read.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from conveyor.parallel.layers import WeightLike, default_weight_loader
from conveyor.workers.hf_config import HFConfig, read_hf_config
from conveyor.workers.models import get_model_class
from conveyor.workers.models.utils import PPMissingLayer

if TYPE_CHECKING:
    from conveyor.workers.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
_SKIP_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
                  "embeddings.position_ids")


def load_hf_config(model_dir: str) -> HFConfig:
    """The HF config of a local checkpoint directory (never downloads)."""
    return read_hf_config(model_dir)


def load_model(model_dir: str, hf_config: Any, dtype: torch.dtype,
               device: torch.device | str,
               pp_layer_partition: list[int] | None = None, expert_parallel: bool = False) -> LlamaForCausalLM:
    """Build this rank's part of the model on `device` and load its weights.

    Uses conveyor.parallel.state for the TP/PP rank, so call init_distributed first
    when running with several ranks. expert_parallel: a mixture of experts
    spreads its experts over the TP ranks (conveyor/workers/layers/moe.py).
    """
    cls = get_model_class(hf_config)
    with torch.device(device):
        model = cls(hf_config, dtype, pp_layer_partition=pp_layer_partition, expert_parallel=expert_parallel)
    load_weights(model, model_dir)
    return model.eval()


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, _INDEX)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iterate_checkpoint(model_dir: str) -> Iterator[tuple[str, WeightLike]]:
    """(name, lazy slice) pairs; a slice is only valid until the next one."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


def _map_name(name: str, mapping: dict[str, tuple[str, Any]],
              experts: dict[str, tuple[str, int | None]]) -> tuple[str, Any]:
    """HF name -> (our parameter name, shard id or None). One expert's tensor
    ("...experts.E.w1.weight") goes to the stacked parameter with shard (E, part)."""
    m = _EXPERT.search(name) if experts else None
    if m is not None and m.group(2) in experts:
        ours, part = experts[m.group(2)]
        return f"{name[:m.start()]}.experts.{ours}", (int(m.group(1)), part)
    for hf_module, (ours, shard_id) in mapping.items():
        if f".{hf_module}." in name:
            return name.replace(f".{hf_module}.", f".{ours}."), shard_id
    return name, None


class _LoadTracker:
    """Which parameters (and which shards of fused ones) have been filled."""

    def __init__(self, model: nn.Module) -> None:
        mapping = getattr(model, "packed_modules_mapping", {})
        self.shards_of: dict[str, set[Any]] = {}
        for ours, shard_id in mapping.values():
            self.shards_of.setdefault(ours, set()).add(shard_id)
        self.seen: dict[int, set[Any]] = {}
        # (our stacked expert parameter, part) -> the checkpoint's name of one expert's tensor
        self.expert_names = {v: k for k, v in getattr(model, "expert_checkpoint_names", {}).items()}

    def record(self, param: nn.Parameter, shard_id: Any) -> None:
        self.seen.setdefault(id(param), set()).add(shard_id)

    def _missing_experts(self, name: str, shards: set[tuple[int, int | None]]) -> list[str]:
        prefix, ours = name.rsplit(".", 1)
        return [f"{prefix}.{e}.{self.expert_names.get((ours, part), ours)}.weight"
                for e, part in sorted(shards, key=lambda s: (s[0], -1 if s[1] is None else s[1]))]

    def missing(self, model: nn.Module) -> list[str]:
        out = []
        for name, param in model.named_parameters():  # tied params appear once
            got = self.seen.get(id(param))
            module = name.split(".")[-2] if "." in name else ""
            expected = getattr(param, "expected_shards", None)
            if expected is not None:  # stacked experts: name each missing checkpoint tensor
                out += self._missing_experts(name, expected - (got or set()))
                continue
            need = self.shards_of.get(module, {None})
            if got is None:
                out.append(name)
            elif None not in got and not need <= got:
                out.append(f"{name} (shards {sorted(map(str, need - got))})")
        return out


def _targets(name: str, params: dict[str, nn.Parameter], tied: bool) -> list[str]:
    """Parameters fed by checkpoint tensor `name`. Tied embeddings also feed
    lm_head — unless lm_head.weight is the embedding Parameter itself (one PP
    stage), or absent (not the last stage)."""
    if tied and name == "model.embed_tokens.weight":
        head = params.get("lm_head.weight")
        if head is not None and head is not params.get(name):
            return [name, "lm_head.weight"]
    return [name]


def load_weights(model: nn.Module, model_dir: str) -> None:
    mapping = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    missing_prefixes = tuple(f"{n}." for n, m in model.named_modules()
                             if isinstance(m, PPMissingLayer))
    tied = bool(getattr(model, "tie_word_embeddings", False))
    experts = getattr(model, "expert_checkpoint_names", {})
    tracker, unexpected = _LoadTracker(model), []
    # A family whose checkpoints name modules under other prefixes (LLaVA's
    # "language_model.model." is our "model.") lists (theirs, ours) pairs.
    prefixes = getattr(model, "checkpoint_prefixes", ())
    for name, weight in iterate_checkpoint(model_dir):
        if name.endswith(_SKIP_SUFFIXES):
            continue  # buffers some checkpoints carry, not parameters
        for target in _targets(_renamed(name, prefixes), params, tied):
            if target.startswith(missing_prefixes):
                continue  # owned by another PP stage
            ours, shard_id = _map_name(target, mapping, experts)
            param = params.get(ours)
            if param is None:
                unexpected.append(name)
                continue
            _load_one(param, weight, shard_id, ours, name)
            tracker.record(param, shard_id)
    if unexpected:
        logger.warning("ignored checkpoint tensors with no parameter: %s", unexpected[:20])
    missing = tracker.missing(model)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} parameter(s): "
                         + ", ".join(missing))


def _renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for theirs, ours in prefixes:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def _load_one(param: nn.Parameter, weight: WeightLike, shard_id: Any,
              ours: str, name: str) -> None:
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        if shard_id is None:
            loader(param, weight)
        else:
            loader(param, weight, shard_id)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"loading checkpoint tensor {name!r} into {ours!r}: {e}") from e
