"""LoRA adapters: the request-side handle and the checks of a PEFT adapter
directory (adapter_config.json + adapter_model.safetensors), torch-free.

A directory is checked once, at the edge (LLM.generate, the HTTP server),
against the base model's shapes and `lora.max_lora_rank`: anything this engine
cannot apply exactly is a ValueError that names the field or tensor, never
silently ignored. The workers trust what passed (conveyor/workers/lora/).
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

# HF module name -> (section in a decoder layer, our fused module, sub-projection index)
TARGET_MODULES: dict[str, tuple[str, str, int]] = {
    "q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Fields that change what an adapter computes and this engine does not do:
# each must be absent or falsy (None, false, {}, []).
_UNSUPPORTED = ("modules_to_save", "use_dora", "lora_bias", "fan_in_fan_out", "rank_pattern",
                "alpha_pattern", "layer_replication", "target_parameters", "trainable_token_indices",
                "alora_invocation_tokens", "use_qalora", "use_bdlora")


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """vLLM's handle: LoRARequest(lora_name, lora_int_id, lora_path). The int
    id (>= 1) is the adapter's identity in the engine: slots, prefix-cache keys."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class ModelDims:
    """The base model's projection shapes (from its config.json)."""
    hidden: int
    intermediate: int
    q_out: int
    kv_out: int
    num_layers: int
    moe: bool = False  # its MLPs are mixtures of experts: adapters target attention only

    @classmethod
    def from_hf_config(cls, hf: dict) -> ModelDims:
        hf = hf.get("text_config", hf)
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        kv = hf.get("num_key_value_heads") or heads
        experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        return cls(hf["hidden_size"], hf["intermediate_size"], heads * head_dim, kv * head_dim,
                   hf["num_hidden_layers"], moe=experts > 0)

    @classmethod
    def from_model_dir(cls, path: str) -> ModelDims:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_config(json.load(f))

    def shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of an HF projection."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_out), "k_proj": (h, self.kv_out), "v_proj": (h, self.kv_out),
                "o_proj": (self.q_out, h), "gate_proj": (h, i), "up_proj": (h, i),
                "down_proj": (i, h)}[module]


@dataclass(frozen=True)
class AdapterSpec:
    """What a checked adapter directory holds."""
    path: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: frozenset[str]
    # safetensors key -> (layer, HF module, "A" | "B")
    tensors: dict[str, tuple[int, str, str]]


def _bad(path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {path}: {what}")


def read_adapter_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise _bad(path, "not a directory")
    f = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(f):
        raise _bad(path, f"{CONFIG_FILE} not found (expected a PEFT save_pretrained directory)")
    try:
        with open(f) as fh:
            cfg = json.load(fh)
    except ValueError as e:
        raise _bad(path, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _bad(path, f"{CONFIG_FILE} must hold a JSON object")
    return cfg


def safetensors_header(file: str) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", ...} from a safetensors header (no tensor data read)."""
    try:
        with open(file, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 << 20:
                raise ValueError("header too large")
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(f"{file}: not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


def _check_config(path: str, cfg: dict, max_rank: int) -> tuple[int, float, frozenset[str]]:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _bad(path, f"peft_type: only LORA is supported, got {cfg.get('peft_type')!r}")
    for field in _UNSUPPORTED:
        if cfg.get(field):
            raise _bad(path, f"{field}: not supported (got {cfg[field]!r})")
    if cfg.get("bias", "none") != "none":
        raise _bad(path, f"bias: only 'none' is supported, got {cfg['bias']!r}")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _bad(path, f"r: expected an int >= 1, got {r!r}")
    if r > max_rank:
        raise _bad(path, f"r: rank {r} exceeds lora.max_lora_rank ({max_rank})")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _bad(path, f"lora_alpha: expected a finite number, got {alpha!r}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise _bad(path, f"target_modules: expected a list of module names, got {targets!r}")
    absent = [t for t in targets if t not in TARGET_MODULES]
    if absent:
        raise _bad(path, f"target_modules: {absent} not supported; the targetable modules are "
                         f"{', '.join(TARGET_MODULES)}")
    return r, float(scale), frozenset(targets)


def _check_tensor(path: str, key: str, info: dict, r: int, targets: frozenset[str],
                  dims: ModelDims) -> tuple[int, str, str]:
    m = _KEY.match(key)
    if m is None:
        raise _bad(path, f"tensor {key!r}: not a LoRA A/B weight of a decoder-layer projection")
    layer, section, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    if module not in targets or TARGET_MODULES[module][0] != section:
        raise _bad(path, f"tensor {key!r}: module {module!r} is not in target_modules")
    if layer >= dims.num_layers:
        raise _bad(path, f"tensor {key!r}: layer {layer} >= the model's {dims.num_layers} layers")
    fin, fout = dims.shape(module)
    want = [r, fin] if ab == "A" else [fout, r]
    if list(info.get("shape", [])) != want:
        raise _bad(path, f"tensor {key!r}: shape {info.get('shape')} != expected {want} "
                         f"(r={r} and the base model's projection)")
    if info.get("dtype") not in ("F32", "F16", "BF16"):
        raise _bad(path, f"tensor {key!r}: dtype {info.get('dtype')} not supported")
    return layer, module, ab


def check_adapter(path: str, max_rank: int, dims: ModelDims) -> AdapterSpec:
    """Parse and check a PEFT adapter directory; ValueError naming what is wrong."""
    cfg = read_adapter_config(path)
    r, scale, targets = _check_config(path, cfg, max_rank)
    mlp = sorted(targets & {"gate_proj", "up_proj", "down_proj"})
    if dims.moe and mlp:
        raise _bad(path, f"target_modules: {mlp} not supported on a mixture-of-experts model; "
                         "its adapters may target q_proj, k_proj, v_proj and o_proj")
    wfile = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wfile):
        raise _bad(path, f"{WEIGHTS_FILE} not found")
    tensors = {k: _check_tensor(path, k, v, r, targets, dims)
               for k, v in safetensors_header(wfile).items()}
    pairs: dict[tuple[int, str], set[str]] = {}
    for layer, module, ab in tensors.values():
        pairs.setdefault((layer, module), set()).add(ab)
    unpaired = sorted(k for k, v in pairs.items() if v != {"A", "B"})
    if unpaired:
        raise _bad(path, f"lora_A/lora_B come in pairs; (layer, module) {unpaired[0]} has one")
    if not tensors:
        raise _bad(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    return AdapterSpec(path, r, scale, targets, tensors)


def lora_stats(max_loras: int, running: Iterable, waiting: Iterable) -> dict:
    """SchedulerStats' LoRA fields: requests per adapter name, running and waiting."""
    def per_adapter(reqs: Iterable) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in reqs:
            if r.lora_request is not None:
                out[r.lora_request.lora_name] = out.get(r.lora_request.lora_name, 0) + 1
        return out

    return dict(max_loras=max_loras, lora_running=per_adapter(running), lora_waiting=per_adapter(waiting))
