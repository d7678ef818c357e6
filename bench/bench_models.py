"""Random-weight checkpoints at the shapes people run, for the CPU benches.

``30m`` is bench/offline_throughput.py's Llama (hidden 512, 8 layers, vocab
8192); ``0.5b`` has Qwen2-0.5B's shape (Qwen2 architecture: qkv bias, tied
embeddings, vocab 151936); ``1b`` has Llama-3.2-1B's (hidden 2048, 16 layers,
vocab 128256, tied); ``30m8k`` is the 30M Llama with 8448 positions (the
scaling bench's long contexts). Weights are random (seeded), saved in fp32; the engines
cast at load (``dtype``). A checkpoint is rebuilt only when its spec changes.
"""
from __future__ import annotations

import json
import os

from bench.offline_throughput import DEFAULT_MODEL_DIR, MODEL_SEED, MODEL_SPEC, build_model

MODELS_ROOT = os.environ.get("CONVEYOR_BENCH_MODELS", "/tmp/conveyor-bench-models")

_COMMON = dict(max_position_embeddings=8448, rms_norm_eps=1e-6, initializer_range=0.05,
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
SPECS: dict[str, tuple[str, dict]] = {
    "0.5b": ("qwen2", dict(_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                            num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                            rope_theta=1000000.0)),
    "1b": ("llama", dict(_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                          rope_theta=500000.0)),
}


def model_dir(name: str) -> str:
    """The checkpoint for ``name`` (30m, 0.5b, 1b), built on first use."""
    if name == "30m":
        return build_model(DEFAULT_MODEL_DIR)
    if name == "30m8k":  # the same weights' shape with room for 8k-token contexts
        return build_model(os.path.join(MODELS_ROOT, "llama30m_8k"), spec_of(name))
    if name not in SPECS:
        raise ValueError(f"unknown bench model {name!r}; choose 30m, 30m8k, {', '.join(SPECS)}")
    arch, spec = SPECS[name]
    path = os.path.join(MODELS_ROOT, f"{arch}{name}_random")
    marker = os.path.join(path, "bench_spec.json")
    want = {"arch": arch, **spec, "seed": MODEL_SEED}
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == want:
                return path
    _save_random(arch, spec, path)
    with open(marker, "w") as f:
        json.dump(want, f)
    return path


def _save_random(arch: str, spec: dict, path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(MODEL_SEED)
    cfg_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    with torch.device("meta"):
        model = model_cls(cfg_cls(**spec))
    # Materialise directly (HF's init would run twice); norms near 1 so they matter.
    model = model.to_empty(device="cpu").to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, spec["initializer_range"])
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)


def spec_of(name: str) -> dict:
    if name == "30m8k":
        return {**MODEL_SPEC, "max_position_embeddings": 8448}
    return MODEL_SPEC if name == "30m" else SPECS[name][1]
