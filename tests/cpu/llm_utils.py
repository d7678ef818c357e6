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


def top_ids(lp: dict[int, float], k: int = 5) -> set[int]:
    """The k most likely token ids of one position's {token_id: logprob}."""
    return set(sorted(lp, key=lambda t: -lp[t])[:k])


def hf_top5(path: str, prompt: list[int], continuation: list[int]) -> list[set[int]]:
    """transformers' top-5 token ids at each position of `continuation`."""
    lp = hf_logprobs(path, prompt, continuation)
    return [set(row.topk(5).indices.tolist()) for row in lp]


def engine_top5(output) -> list[set[int]]:
    """Top-5 ids per generated token of a CompletionOutput made with logprobs>=5."""
    assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
    return [top_ids(d) for d in output.logprobs]


def close_or_why(ours: list[int], our_top5: list[set[int]], ref: list[int],
                 ref_top5: list[set[int]]) -> str | None:
    """vLLM's rule where two fp32 paths may round differently: equal lengths,
    and the sequences are equal, or at the first divergence each side's token
    is in the other side's top-5 (after it they may differ freely). None when
    the rule holds, else what broke it."""
    if len(ours) != len(ref):
        return f"lengths differ: {len(ours)} vs {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            if a in ref_top5[i] and b in our_top5[i]:
                return None
            return f"first divergence at {i}: {a} vs {b} is outside the other side's top-5"
    return None


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


def wait_pids_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait on pidfds (no sleep loop) until every pid has exited; returns the
    ones still running after timeout_s (a zombie counts as exited)."""
    import select
    import time

    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        left = dict(fds)
        deadline = time.monotonic() + timeout_s
        while left and (remaining := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(remaining * 1000):
                poller.unregister(fd)
                left.pop(fd, None)
        return sorted(left.values())
    finally:
        for fd in fds:
            os.close(fd)
