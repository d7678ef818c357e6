"""The random-weight checkpoints of every benchmark, built on first use: one
builder, one table of shapes.

``model_dir(name)`` returns the checkpoint for a name of ``SPECS`` (built at
its default place unless ``path`` names another); ``build(path, spec)``
builds any spec. A checkpoint is rebuilt only when its spec changes (a
``bench_spec.json`` beside the weights records what was built; it is written
last, so an interrupted build is redone); a checkpoint without one (a real
model passed with --model-dir) is used as it is.

Two ways to fill the weights, seeded (``MODEL_SEED``):
- ``hf``: transformers' own initialisation, then the norms randomised near 1
  so they matter. The small models: their exact weights are part of some
  workloads (``tiny_cycles``' greedy output falls into cycles).
- ``normal``: built on the meta device and filled in place (every weight
  N(0, initializer_range), norms near 1, biases small): the large shapes,
  where transformers' initialisation would run for minutes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "bench", "out")
MODELS_ROOT = os.environ.get("CONVEYOR_BENCH_MODELS", "/tmp/conveyor-bench-models")
MODEL_SEED = 0


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint's architecture (a transformers model_type), its config,
    how its weights are filled, its tokenizer's vocabulary (0: none, prompts
    are token ids) and where it is built by default."""
    arch: str
    config: dict[str, Any]
    init: str = "hf"
    tokenizer_vocab: int = 0
    default_dir: str = ""
    dtype: str = "float32"
    # > 0: routers (``*.mlp.gate.weight``) drawn N(0, router_std) (transformers
    # zero-initialises them: every expert would tie); recorded only when set.
    router_std: float = 0.0


# bench/offline_throughput.py's Llama: ~30M parameters, no tokenizer.
LLAMA_30M: dict[str, Any] = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=8192,
    max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.05,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
# The tests' tiny Llama shape, with the demo tokenizer's special ids and room
# for configs/tiny-cpu.yaml's 4096-token context.
TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
    rms_norm_eps=1e-6, initializer_range=0.05, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=3,
)
_LARGE = dict(max_position_embeddings=8448, rms_norm_eps=1e-6, initializer_range=0.05,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
_FLOOR = dict(max_position_embeddings=8192, rms_norm_eps=1e-6, initializer_range=0.02,
              tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
# Qwen3-30B-A3B's layout scaled down: 16 experts, top-4, hidden 1024 (288M parameters, ~105M active)
QWEN3_MOE: dict[str, Any] = dict(
    _FLOOR, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_experts=16,
    num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000,
    max_position_embeddings=4096, rope_theta=1000000.0)

SPECS: dict[str, ModelSpec] = {
    "30m": ModelSpec("llama", LLAMA_30M, default_dir=os.path.join(OUT, "llama30m")),
    # the same shape with room for 8k-token contexts (bench/scaling.py)
    "30m8k": ModelSpec("llama", {**LLAMA_30M, "max_position_embeddings": 8448},
                       default_dir=os.path.join(MODELS_ROOT, "llama30m_8k")),
    # vocab 512 and the demo tokenizer: servers, grammars and chat need text
    "30m_v512": ModelSpec("llama", {**LLAMA_30M, "vocab_size": 512, "bos_token_id": 0,
                                    "eos_token_id": 1, "pad_token_id": 3},
                          tokenizer_vocab=512, default_dir=os.path.join(OUT, "llama30m_v512")),
    # a small Llama whose greedy output settles into cycles within a few dozen
    # tokens (bench/spec_decode.py's copy-heavy workload); head_dim 32 for vLLM's CPU attention
    "tiny_cycles": ModelSpec("llama", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=2048,
        rms_norm_eps=1e-6, initializer_range=0.05, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0), default_dir=os.path.join(OUT, "llama_tiny_cycles")),
    "tiny": ModelSpec("llama", TINY, tokenizer_vocab=512, default_dir=os.path.join(OUT, "tiny-llama")),
    # Qwen2-0.5B's and Llama-3.2-1B's shapes (bench/compare_vllm.py --model, bench/scaling.py)
    "0.5b": ModelSpec("qwen2", dict(_LARGE, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                    num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                    rope_theta=1000000.0),
                      init="normal", default_dir=os.path.join(MODELS_ROOT, "qwen20.5b_random")),
    "1b": ModelSpec("llama", dict(_LARGE, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                  vocab_size=128256, rope_theta=500000.0),
                    init="normal", default_dir=os.path.join(MODELS_ROOT, "llama1b_random")),
    # bench/decode_floor.py: a ~1B Llama in bf16 (vocab 32000) and its CPU dry-run twin
    "floor-1b": ModelSpec("llama", dict(_FLOOR, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=64, vocab_size=32000),
                          init="normal", tokenizer_vocab=512, dtype="bfloat16",
                          default_dir=os.path.join(MODELS_ROOT, "llama_floor_1b")),
    # bench/moe.py: a Qwen3-MoE shape (16 experts, top-4, hidden 1024), without and with a tokenizer
    "qwen3moe": ModelSpec("qwen3_moe", QWEN3_MOE, init="normal", router_std=1.0,
                          default_dir=os.path.join(MODELS_ROOT, "qwen3moe_16e")),
    "qwen3moe_v512": ModelSpec("qwen3_moe", {**QWEN3_MOE, "vocab_size": 512, "bos_token_id": 0,
                                             "eos_token_id": 1, "pad_token_id": 3},
                               init="normal", router_std=1.0, tokenizer_vocab=512,
                               default_dir=os.path.join(MODELS_ROOT, "qwen3moe_16e_v512")),
    "floor-tiny": ModelSpec("llama", dict(_FLOOR, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          vocab_size=512, max_position_embeddings=2048),
                            init="normal", tokenizer_vocab=512, dtype="bfloat16",
                            default_dir=os.path.join(MODELS_ROOT, "llama_floor_tiny")),
}


def model_dir(name: str, path: str | None = None, device: str = "cpu") -> str:
    """The checkpoint of ``SPECS[name]`` at ``path`` (default: its own place),
    built there first when missing or built from another spec."""
    if name not in SPECS:
        raise ValueError(f"unknown bench model {name!r}; choose from {', '.join(SPECS)}")
    spec = SPECS[name]
    return build(path or spec.default_dir, spec, device=device)


def build(path: str, spec: ModelSpec, device: str = "cpu") -> str:
    """Write ``spec``'s random-weight checkpoint (and tokenizer) into ``path``
    unless the one there was built from the same spec; returns ``path``."""
    marker = os.path.join(path, "bench_spec.json")
    want = {"arch": spec.arch, "init": spec.init, "seed": MODEL_SEED, "dtype": spec.dtype,
            "tokenizer_vocab": spec.tokenizer_vocab, **spec.config}
    if spec.router_std:
        want["router_std"] = spec.router_std
    if _reties(spec):  # recorded: checkpoints built before the re-tie (two head matrices) are rebuilt
        want["tied_head"] = True
    if os.path.isfile(os.path.join(path, "config.json")):
        if not os.path.isfile(marker):
            return path  # a checkpoint this module did not build: used as it is, never overwritten
        with open(marker) as f:
            if json.load(f) == want:
                return path
    _save_weights(path, spec, device)
    if spec.tokenizer_vocab:
        from conveyor.cluster.demo.model import train_tiny_tokenizer

        train_tiny_tokenizer(path, vocab_size=spec.tokenizer_vocab)
    with open(marker, "w") as f:
        json.dump(want, f)
    return path


def _save_weights(path: str, spec: ModelSpec, device: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(MODEL_SEED)
    cfg = AutoConfig.for_model(spec.arch, **spec.config)
    dtype = getattr(torch, spec.dtype)
    if spec.init == "hf":
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dtype)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        model = model.to_empty(device=device).to(dtype)
        if _reties(spec):
            model.tie_weights()  # to_empty() gave lm_head a tensor of its own
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif spec.router_std and name.endswith("mlp.gate.weight"):
                p.normal_(0.0, spec.router_std)
            elif spec.init == "hf":
                continue
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, spec.config["initializer_range"])
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)


def _reties(spec: ModelSpec) -> bool:
    """A tied config built on the meta device: to_empty() unties lm_head from the
    embedding, and filled apart the two were saved as different matrices under a config
    that says they are one; engines then disagree on which is the head (transformers
    and llama.cpp took lm_head.weight, ours the embedding)."""
    return spec.init != "hf" and bool(spec.config.get("tie_word_embeddings"))


def param_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama-shaped config without biases (a report's "30M")."""
    h, i, layers, v = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                           "vocab_size"))
    q, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // q
    per_layer = h * (q + 2 * kv) * d + q * d * h + 3 * h * i + 2 * h
    embeddings = v * h * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + layers * per_layer + h
