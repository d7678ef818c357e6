"""Sampler semantics: greedy, temperature, top-k/top-p/min-p, seeded
determinism across batch compositions, penalties, min_tokens, logprobs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from conveyor.engine.sampling_params import SamplingParams
from conveyor.workers.sampler import Sampler, SamplerOutput, SamplingMetadata, apply_penalties, plain_greedy, row_argmax

CPU = torch.device("cpu")


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    eos_token_id: int | None = None


def row(**kw: object) -> Row:
    prompt = kw.pop("prompt", [])
    output = kw.pop("output", [])
    eos = kw.pop("eos", None)
    sp = SamplingParams(**kw)  # type: ignore[arg-type]
    gen = None
    if sp.seed is not None:
        gen = torch.Generator().manual_seed(sp.seed)
    return Row(sp, list(prompt), list(output), gen, eos)  # type: ignore[arg-type]


def sample(logits: torch.Tensor, rows: list[Row]) -> SamplerOutput:
    meta = SamplingMetadata.build(rows, logits.shape[-1], CPU)
    return Sampler()(logits, meta)


def logits_from_probs(probs: list[float], batch: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(batch, -1).contiguous()


def freqs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = sample(logits, [row(temperature=0.0) for _ in range(6)])
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs is None and out.to_lists() is None


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    rows = [row(temperature=1.5, top_k=1, seed=i if i % 2 else None) for i in range(8)]
    out = sample(logits, rows)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    rows = [row(temperature=0.0), row(temperature=1.0, top_k=1),
            row(temperature=0.0), row(temperature=2.0, top_k=1)]
    out = sample(logits, rows)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_empty_batch() -> None:
    out = sample(torch.empty(0, 10), [])
    assert out.sampled_token_ids.shape == (0,)


def test_caller_logits_untouched() -> None:
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    rows = [row(temperature=0.7, top_p=0.5, min_p=0.1, min_tokens=2, eos=3,
                repetition_penalty=1.5, frequency_penalty=1.0, prompt=[1, 2],
                output=[4], logprobs=2),
            row(temperature=0.0, presence_penalty=1.0, output=[5])]
    sample(logits, rows)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- random


def test_temperature_distribution_batched() -> None:
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20000
    out = sample(base.expand(n, -1).contiguous(), [row(temperature=0.7)] * n)
    expected = torch.softmax(base / 0.7, -1)
    assert torch.allclose(freqs(out.sampled_token_ids, 5), expected, atol=0.015)


def test_temperature_distribution_seeded_generator() -> None:
    # One seeded request over many steps (its output growing) draws from
    # softmax(logits / T); each draw depends only on (seed, output position).
    base = torch.tensor([[1.0, 0.0, 0.5, -0.5]])
    r = row(temperature=1.3, seed=7)
    sampler = Sampler()
    toks = []
    for _ in range(4000):
        tok = int(sampler(base, SamplingMetadata.build([r], 4, CPU)).sampled_token_ids[0])
        toks.append(tok)
        r.output_token_ids.append(tok)
    expected = torch.softmax(base[0] / 1.3, -1)
    assert torch.allclose(freqs(torch.tensor(toks), 4), expected, atol=0.03)
    # The same position draws the same token, whatever happened before.
    r2 = row(temperature=1.3, seed=7, output=r.output_token_ids[:100])
    again = int(sampler(base, SamplingMetadata.build([r2], 4, CPU)).sampled_token_ids[0])
    assert again == toks[100]


def test_top_p_excludes_tail() -> None:
    torch.manual_seed(1)
    n = 20000
    # Keep set for p=0.75 is {0, 1}: the dropped ascending prefix {3, 2} has
    # mass 0.2 <= 0.25, adding token 1 would exceed it.
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05], n)
    out = sample(logits, [row(top_p=0.75)] * n)
    f = freqs(out.sampled_token_ids, 4)
    assert f[2] == 0 and f[3] == 0
    assert abs(f[0].item() - 0.5 / 0.8) < 0.02


def test_top_p_always_keeps_top_token() -> None:
    n = 2000
    logits = logits_from_probs([0.6, 0.3, 0.1], n)
    out = sample(logits, [row(top_p=0.01)] * n)
    assert bool((out.sampled_token_ids == 0).all())


def test_top_k_then_top_p() -> None:
    torch.manual_seed(2)
    n = 20000
    # top_k=3 renormalises to ~[0.526, 0.316, 0.158]; top_p=0.8 then drops token 2.
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05], n)
    out = sample(logits, [row(top_k=3, top_p=0.8)] * n)
    f = freqs(out.sampled_token_ids, 4)
    assert f[2] == 0 and f[3] == 0 and f[1] > 0.3


def test_top_k_restricts_support() -> None:
    torch.manual_seed(3)
    n = 20000
    logits = logits_from_probs([0.1, 0.4, 0.2, 0.3], n)
    rows = [row(top_k=2), row(top_k=0)] * (n // 2)  # k=0 rows: full support
    toks = sample(logits, rows).sampled_token_ids
    topk_rows, full_rows = toks[0::2], toks[1::2]
    assert set(topk_rows.tolist()) == {1, 3}
    assert abs(freqs(topk_rows, 4)[1].item() - 4 / 7) < 0.02
    assert set(full_rows.tolist()) == {0, 1, 2, 3}


def test_min_p_excludes_low_tokens() -> None:
    torch.manual_seed(4)
    n = 20000
    # Threshold 0.35 * 0.5 = 0.175: tokens 2 (0.15) and 3 (0.05) go.
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05], n)
    out = sample(logits, [row(min_p=0.35)] * n)
    f = freqs(out.sampled_token_ids, 4)
    assert f[2] == 0 and f[3] == 0
    assert abs(f[0].item() - 0.5 / 0.8) < 0.02


# ---------------------------------------------------------------- seeds


def _seeded_tokens(position: int | None, steps: int = 8) -> list[int]:
    """Run the seeded request for `steps` steps, alone (position None) or at
    `position` in a batch of 16 with assorted other rows; outputs are fed back."""
    vocab = 32
    table = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(99))
    noise = torch.Generator().manual_seed(5)  # the others' logits
    target = row(temperature=0.9, top_p=0.95, frequency_penalty=0.5, seed=1234,
                 prompt=[1, 2, 3])
    others = [r for i in range(3) for r in (
        row(temperature=0.0), row(temperature=1.0), row(seed=77 + i, top_k=5),
        row(temperature=0.5, min_p=0.2, repetition_penalty=1.3, prompt=[0, 4]),
        row(top_k=3, top_p=0.5, seed=3 + i), row(presence_penalty=1.0))]
    batch = [target] if position is None else others[:15]
    if position is not None:
        batch.insert(position, target)
    idx = position or 0
    for step in range(steps):
        logits = torch.randn(len(batch), vocab, generator=noise)
        logits[idx] = table[step]
        sampled = sample(logits, batch).sampled_token_ids.tolist()
        for r, t in zip(batch, sampled):
            r.output_token_ids.append(t)
    return target.output_token_ids


def test_seeded_row_independent_of_batch() -> None:
    alone = _seeded_tokens(None)
    assert len(set(alone)) > 1  # actually random, not degenerate
    for pos in (0, 7, 15):
        assert _seeded_tokens(pos) == alone


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    a = sample(logits, [row(seed=1)]).sampled_token_ids
    b = sample(logits, [row(seed=2)]).sampled_token_ids
    c = sample(logits, [row(seed=1)]).sampled_token_ids
    assert torch.equal(a, c) and not torch.equal(a, b)


# ---------------------------------------------------------------- penalties


def _penalized(logits: list[float], r: Row) -> torch.Tensor:
    meta = SamplingMetadata.build([r], len(logits), CPU)
    assert meta.penalties is not None
    return apply_penalties(torch.tensor([logits]), meta.penalties)[0]


def test_penalty_formulas_exact() -> None:
    logits = [1.0, 2.0, -1.0, 3.0, 0.5, -2.0]
    r = row(temperature=0.0, prompt=[1, 5], output=[2, 2, 3],
            repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([
        1.0,                      # unseen
        2.0 / 2.0,                # prompt only: repetition, positive -> divide
        -1.0 * 2.0 - 0.5 * 2 - 0.25,  # output x2: multiply, freq x2, presence
        3.0 / 2.0 - 0.5 - 0.25,   # output x1
        0.5,                      # unseen
        -2.0 * 2.0,               # prompt only, negative -> multiply
    ])
    assert torch.allclose(_penalized(logits, r), expected)


def test_presence_and_frequency_ignore_prompt() -> None:
    logits = [1.0, 1.0, 1.0]
    r = row(prompt=[0], output=[1, 1], frequency_penalty=0.3, presence_penalty=0.2)
    expected = torch.tensor([1.0, 1.0 - 0.6 - 0.2, 1.0])
    assert torch.allclose(_penalized(logits, r), expected)


def test_penalties_change_greedy_pick() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.0, 0.0]] * 4)
    rows = [row(temperature=0.0),
            row(temperature=0.0, output=[0], frequency_penalty=0.2),  # 2.8 < 2.9
            row(temperature=0.0, prompt=[0, 1], repetition_penalty=2.0),  # 1.5, 1.45 < 2
            row(temperature=0.0, output=[0], presence_penalty=0.05)]  # 2.95 > 2.9
    assert sample(logits, rows).sampled_token_ids.tolist() == [0, 1, 2, 0]


def test_no_penalties_fast_path() -> None:
    meta = SamplingMetadata.build([row(output=[1, 2])], 8, CPU)
    assert meta.penalties is None and meta.min_tokens_index is None
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None


# ---------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids(ignore_eos: bool) -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 4.0, 0.0, 5.0]])
    r = row(temperature=0.0, min_tokens=3, stop_token_ids=[5], eos=7,
            ignore_eos=ignore_eos)
    picks = []
    for _ in range(4):
        t = sample(logits, [r]).sampled_token_ids.item()
        picks.append(t)
        r.output_token_ids.append(t)
    assert picks == [1, 1, 1, 7]


def test_min_tokens_random_rows_never_stop() -> None:
    torch.manual_seed(6)
    n = 5000
    logits = logits_from_probs([0.1, 0.1, 0.4, 0.4], n)
    rows = [row(min_tokens=2, stop_token_ids=[2], eos=3, output=[0])] * n
    toks = sample(logits, rows).sampled_token_ids
    assert set(toks.tolist()) == {0, 1}


# ---------------------------------------------------------------- logprobs


def _ranks(logprobs: torch.Tensor, tokens: torch.Tensor) -> list[int]:
    order = logprobs.argsort(dim=-1, descending=True, stable=True).tolist()
    return [o.index(t) + 1 for o, t in zip(order, tokens.tolist())]


def test_logprobs_are_raw_and_topk_sorted() -> None:
    torch.manual_seed(8)
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(9)) * 3
    asked = [None, 0, 3, 5, 2]
    rows = [row(temperature=0.0 if i == 0 else 1.2, logprobs=k,
                repetition_penalty=1.8, prompt=[0, 1, 2], top_p=0.9)
            for i, k in enumerate(asked)]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.logprobs.shape == (5, 6) and out.logprobs.dtype == torch.float32
    assert out.logprob_token_ids.shape == (5, 6)
    assert out.sampled_ranks is not None and out.sampled_ranks.shape == (5,)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(5, -1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    assert bool((out.logprobs[:, 1:].diff(dim=-1) <= 0).all())
    assert out.sampled_ranks.tolist() == _ranks(raw, sampled)


def test_greedy_rank_is_one_and_rank_of_forced_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    # Row 1 is forced onto token 2 (third best raw) by min_tokens masking.
    rows = [row(temperature=0.0, logprobs=1),
            row(temperature=0.0, logprobs=1, min_tokens=1, stop_token_ids=[1, 3])]
    out = sample(logits, rows)
    assert out.sampled_token_ids.tolist() == [1, 2]
    assert out.sampled_ranks is not None
    assert out.sampled_ranks.tolist() == [1, 3]
    assert out.logprob_token_ids is not None
    assert out.logprob_token_ids.tolist() == [[1, 1], [2, 1]]


def test_to_lists_shapes() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(10))
    out = sample(logits, [row(logprobs=4), row(logprobs=0), row()])
    lists = out.to_lists()
    assert lists is not None
    assert len(lists.token_ids) == 3 and all(len(t) == 5 for t in lists.token_ids)
    assert len(lists.logprobs) == 3 and all(len(t) == 5 for t in lists.logprobs)
    assert all(isinstance(v, float) and v <= 0 and math.isfinite(v)
               for lp in lists.logprobs for v in lp)
    assert len(lists.sampled_ranks) == 3
    assert all(isinstance(r, int) and r >= 1 for r in lists.sampled_ranks)


def test_logprobs_zero_gives_sampled_column_only() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(11))
    out = sample(logits, [row(logprobs=0), row(temperature=0.0, logprobs=0)])
    assert out.logprobs is not None and out.logprobs.shape == (2, 1)
    lists = out.to_lists()
    assert lists is not None and [len(t) for t in lists.token_ids] == [1, 1]


# ---------------------------------------------------------------- logit_bias, allowed_token_ids


def test_logit_bias_forces_and_bans_tokens_greedy_and_random() -> None:
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3))
    rows = [row(temperature=0.0, logit_bias={17: 100.0}),
            row(temperature=1.0, seed=5, logit_bias={17: 100.0}),
            row(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0}, logprobs=2),
            row(temperature=0.0)]
    out = sample(logits, rows)
    got = out.sampled_token_ids.tolist()
    assert got[0] == 17 and got[1] == 17
    assert got[2] == int(logits[2].topk(2).indices[1])  # the banned argmax gives way
    assert got[3] == int(logits[3].argmax())  # rows without a bias are untouched
    # Logprobs stay the raw model's (vLLM's default), not the biased ones.
    raw = torch.log_softmax(logits[2], -1)
    assert out.logprobs[2, 0].item() == pytest.approx(raw[got[2]].item(), abs=1e-6)


def test_logit_bias_adds_exactly() -> None:
    logits = torch.zeros(1, 5)
    meta = SamplingMetadata.build([row(temperature=0.0, logit_bias={1: 0.5, 3: -2.0})], 5, CPU)
    from conveyor.workers.sampler import process_logits
    x, _ = process_logits(logits, meta)
    assert x.tolist() == [[0.0, 0.5, 0.0, -2.0, 0.0]]
    assert logits.abs().sum() == 0  # the caller's logits are never modified


def test_allowed_token_ids_restrict_support() -> None:
    logits = torch.zeros(2, 30)
    rows = [row(temperature=1.0, seed=s, allowed_token_ids=[3, 7, 11]) for s in range(2)]
    seen = set()
    for _ in range(40):
        seen.update(sample(logits, rows).sampled_token_ids.tolist())
        rows = [row(temperature=1.0, seed=r.sampling_params.seed + 2, allowed_token_ids=[3, 7, 11])
                for r in rows]
    assert seen == {3, 7, 11}
    greedy = sample(torch.randn(1, 30), [row(temperature=0.0, allowed_token_ids=[9])])
    assert greedy.sampled_token_ids.tolist() == [9]


@pytest.mark.parametrize("kw, msg", [
    ({"logit_bias": {5: 100.5}}, "logit_bias must be <= 100"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias must be finite"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias must be >= 0"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "at most 300"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be >= 0"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be <= 20"),
])
def test_bias_allowed_prompt_logprobs_validation(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw,plain", [
    ({"temperature": 0.0}, True),
    ({"temperature": 0.0, "min_tokens": 2, "output": [5, 6]}, True),  # min_tokens reached
    ({"temperature": 0.0, "min_tokens": 3, "output": [5, 6], "eos": 1}, False),
    ({"temperature": 0.5}, False),
    ({"temperature": 0.0, "logprobs": 0}, False),
    ({"temperature": 0.0, "repetition_penalty": 2.0, "output": [1]}, False),
    ({"temperature": 0.0, "frequency_penalty": 2.0, "output": [1, 1, 1]}, False),
    ({"temperature": 0.0, "presence_penalty": 2.0, "output": [1]}, False),
    ({"temperature": 0.0, "allowed_token_ids": [3]}, False),
    ({"temperature": 0.0, "logit_bias": {3: 100.0}}, False),
])
def test_plain_greedy_rows_sample_the_raw_argmax(kw: dict[str, object], plain: bool) -> None:
    """plain_greedy (the model runner samples such a step by argmax alone) holds
    exactly when the Sampler's tokens are the argmax of the raw logits for
    every logits tensor; a row it rejects changes the tokens for some tensor."""
    r = row(**kw)
    assert plain_greedy([row(temperature=0.0), r]) is plain
    torch.manual_seed(0)
    logits = torch.randn(64, 8)
    logits[:, 3] -= 50.0  # token 3 is never the raw argmax: a bias or allowed list makes it one
    logits[:, 1] += 5.0  # token 1 (the EOS above, the output above) mostly is: min_tokens or a penalty removes it
    argmax = row_argmax(logits)
    sampled = sample(logits, [r] * 64).sampled_token_ids
    if plain:
        assert torch.equal(sampled, argmax)
    elif kw.get("temperature") == 0.0 and "logprobs" not in kw:
        assert not torch.equal(sampled, argmax)
