"""Shared fixtures for end-to-end tests: tiny checkpoints with a tokenizer and
transformers' greedy reference."""
from __future__ import annotations

import os
import random
from functools import lru_cache

import torch

from tiny_models import make_tiny_model
from tokenizer_utils import train_tiny_tokenizer

BOS, EOS = 0, 1  # the tiny tokenizer's ids; checkpoints are made to agree


def make_checkpoint(family: str, path: str, **overrides) -> str:
    make_tiny_model(family, path, bos_token_id=BOS, eos_token_id=EOS, **overrides)
    train_tiny_tokenizer(path)
    return path


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 512,
                   prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


@lru_cache(maxsize=8)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ignoring EOS."""
    model = _hf_model(path)
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def hf_logprobs(path: str, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log-softmax at each generated position: [len(continuation), vocab]."""
    model = _hf_model(path)
    ids = torch.tensor([prompt + continuation])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


def top5_agree(ours: list[int], ref: list[int], path: str, prompt: list[int]) -> bool:
    """vLLM's rule where two fp32 paths may round differently: at the first
    divergence each side's token must be in the other side's top-5."""
    if ours == ref:
        return True
    i = next(k for k, (a, b) in enumerate(zip(ours, ref)) if a != b)
    lp = hf_logprobs(path, prompt, ref[:i + 1])[i]
    top5 = set(torch.topk(lp, 5).indices.tolist())
    return ours[i] in top5 and ref[i] in top5


def tmpdir(base: str, name: str) -> str:
    p = os.path.join(base, name)
    os.makedirs(p, exist_ok=True)
    return p


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
