"""Token-id prompts and sampling mixes the benchmarks share, so that two
engines (or two runs) given the same seed get the same requests.

``make_prompts`` (numpy) is what the offline benches and their vLLM peers
draw; it must load under the peer's Python too (stdlib + numpy at import).
"""
from __future__ import annotations

import random
from typing import Any


def make_prompts(n: int, seed: int, vocab: int, lo: int = 16, hi: int = 256) -> list[list[int]]:
    """n prompts of lo..hi token ids drawn from 3..vocab-1 (ids 0..2 are
    pad/bos/eos), numpy's generator: the offline benches' prompts."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=n)
    return [rng.integers(3, vocab, size=int(length)).tolist() for length in lens]


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 512) -> list[list[int]]:
    """n prompts of lo..hi ids drawn from 4..vocab-1 with Python's random
    (the tests' random_prompts, so a bench and a test can share a workload)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def mixed_params(n: int, max_tokens: int) -> list[Any]:
    """SamplingParams for n requests of exactly max_tokens tokens: even ones
    greedy, odd ones seeded at temperature 0.8 (both paths reproducible, so
    an output can be compared with an undisturbed run's)."""
    from conveyor.engine import SamplingParams

    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0) if i % 2 == 0 else
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=100 + i)
            for i in range(n)]
