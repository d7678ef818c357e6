"""The n-gram proposer and the rejection sampler, without a model: exact
distributions (chi-square against the processed target), greedy acceptance,
per-position penalties / min_tokens, seeded determinism, logprob rows."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.spec_decode.ngram import NgramProposer, find_ngram_draft
from conveyor.workers.rejection_sampler import SpecLayout, sample_with_drafts
from conveyor.workers.sampler import Sampler, SamplingMetadata

V = 8
CPU = torch.device("cpu")


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [3, 4])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    eos_token_id: int | None = None


def chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness-of-fit p-value (cells with expected count < 5 pooled)."""
    expected = probs * counts.sum()
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def target(logits: torch.Tensor, temperature: float, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """Reference: softmax(logits / T), the smallest top set with mass >= top_p,
    then tokens below min_p x the top probability dropped."""
    p = torch.softmax(logits.double() / temperature, -1).numpy()
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    keep = order[:int(np.searchsorted(cum, top_p - 1e-12)) + 1]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    out = out / out.sum()
    out[out < min_p * out.max()] = 0.0
    return out / out.sum()


# ---- proposer ---------------------------------------------------------------------

def test_ngram_longest_then_latest_full_match():
    toks = np.array([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3])
    # [1, 2, 3] ends at 3 and at 8; the later one has 3 tokens after it.
    assert find_ngram_draft(toks, 3, 2, 4).tolist() == [9, 9, 1]
    # Longer matches win over more recent shorter ones.
    toks = np.array([7, 1, 2, 5, 6, 8, 1, 2, 0, 7, 1, 2])
    assert find_ngram_draft(toks, 2, 2, 4).tolist() == [5, 6]


def test_ngram_no_match_and_bounds():
    assert find_ngram_draft(np.array([1, 2, 3, 4]), 3, 2, 4).size == 0
    assert find_ngram_draft(np.array([1, 2]), 3, 1, 4).tolist() == []  # [2] never occurred before
    # Too short a suffix match (below n_min): nothing.
    assert find_ngram_draft(np.array([5, 1, 9, 1]), 3, 2, 4).size == 0
    # Only what exists after the match is proposed.
    assert find_ngram_draft(np.array([5, 6, 7, 5, 6]), 4, 1, 3).tolist() == [7, 5, 6]


def test_ngram_proposer_buffers_and_caps():
    prop = NgramProposer(k=4, n_min=1, n_max=3)
    toks = [1, 2, 3, 1, 2]
    assert prop.propose("a", toks, 10) == [3, 1, 2]
    toks += [3, 1]
    assert prop.propose("a", toks, 2) == [2, 3]  # caller's room caps k
    assert prop.propose("a", toks, 0) == []
    prop.drop("a")
    assert prop.propose("a", [9, 9], 4) == [9]


@pytest.mark.parametrize("n_min,n_max", [(1, 3), (2, 4), (3, 3)])
def test_ngram_proposer_gate_agrees_with_the_search(n_min, n_max):
    """Growing sequences over a small vocab: the proposer (with its miss gate,
    fed incrementally) proposes exactly what the stateless search finds."""
    rng = np.random.default_rng(n_min)
    prop = NgramProposer(k=3, n_min=n_min, n_max=n_max)
    for r in range(20):
        toks: list[int] = []
        for _ in range(60):
            toks.append(int(rng.integers(0, 6)))
            want = find_ngram_draft(np.array(toks), 3, n_min, n_max).tolist()
            assert prop.propose(str(r), toks, 3) == want
        prop.drop(str(r))


# ---- rejection sampler -------------------------------------------------------------

def _run(logits_rows: torch.Tensor, states: list[Row], drafts: list[list[int]]):
    layout = SpecLayout.build(drafts)
    return sample_with_drafts(logits_rows, states, layout, V, CPU)


@pytest.mark.parametrize("top_p,min_p", [(1.0, 0.0), (0.9, 0.0), (1.0, 0.15)])
def test_rejection_sampling_matches_target(top_p, min_p):
    torch.manual_seed(0)
    n = 20000
    row0, row1 = torch.randn(V) * 1.5, torch.randn(V) * 1.5
    p0 = target(row0, 1.0, top_p, min_p)
    draft = int(np.argsort(-p0)[1])  # a likely but not the likeliest draft
    sp = SamplingParams(temperature=1.0, top_p=top_p, min_p=min_p, max_tokens=8)
    logits = torch.stack([row0, row1]).repeat(n, 1)
    emitted, _ = _run(logits, [Row(sp) for _ in range(n)], [[draft]] * n)
    first = np.bincount([e[0] for e in emitted], minlength=V)
    assert chi2_p(first, p0) > 0.01
    # After an accepted draft the bonus row samples the next position's target.
    second = np.bincount([e[1] for e in emitted if len(e) == 2], minlength=V)
    assert second.sum() == first[draft]
    assert chi2_p(second, target(row1, 1.0, top_p, min_p)) > 0.01
    # Acceptance rate is p0(draft).
    assert abs(first[draft] / n - p0[draft]) < 4 * np.sqrt(p0[draft] / n)


def test_rejected_draft_never_reemitted_when_residual_has_mass():
    torch.manual_seed(1)
    n = 4000
    row = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0])
    sp = SamplingParams(temperature=1.0, max_tokens=8)
    emitted, _ = _run(torch.stack([row, row]).repeat(n, 1), [Row(sp) for _ in range(n)], [[0]] * n)
    # Rejected at position 0 -> one token, drawn from p without token 0.
    rejected = [e[0] for e in emitted if len(e) == 1]
    assert rejected and 0 not in rejected


def test_greedy_accepts_prefix_then_argmax():
    rows = torch.full((4, V), -5.0)
    for i, t in enumerate([2, 5, 7, 1]):
        rows[i, t] = 5.0
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    emitted, _ = _run(rows, [Row(sp)], [[2, 5, 3]])
    assert emitted == [[2, 5, 7]]  # d2=3 != argmax 7
    emitted, _ = _run(rows, [Row(sp)], [[2, 5, 7]])
    assert emitted == [[2, 5, 7, 1]]  # all accepted + bonus


def test_min_tokens_and_penalties_see_earlier_drafts():
    eos = 6
    rows = torch.zeros(3, V)
    rows[:, eos] = 4.0
    rows[:, 2] = 3.0
    # min_tokens=2: EOS is masked at positions 0 and 1, allowed at 2.
    sp = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2)
    emitted, _ = _run(rows, [Row(sp, eos_token_id=eos)], [[2, 2]])
    assert emitted == [[2, 2, eos]]
    # A presence penalty sees draft 0 as output at position 1.
    sp = SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=2.0)
    rows = torch.zeros(3, V)
    rows[:, 2], rows[:, 3] = 3.0, 2.0
    emitted, _ = _run(rows, [Row(sp)], [[2, 2]])
    assert emitted == [[2, 3]]


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(2)
    rows = torch.randn(4, V)
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=8)

    def alone():
        g = torch.Generator().manual_seed(7)
        return _run(rows[:3], [Row(sp, generator=g)], [[1, 2]])[0][0]

    def batched():
        g = torch.Generator().manual_seed(7)
        other = Row(SamplingParams(temperature=1.0, max_tokens=8))
        logits = torch.cat([torch.randn(2, V), rows[:3]])
        return _run(logits, [other, Row(sp, generator=g)], [[4], [1, 2]])[0][1]

    assert all(alone() == batched() for _ in range(5))


def test_no_draft_row_matches_plain_sampler_when_seeded():
    """A seeded row without a draft in a speculating batch draws exactly what
    the plain Sampler draws."""
    torch.manual_seed(3)
    row = torch.randn(1, V)
    sp = SamplingParams(temperature=0.8, top_k=5, seed=11, max_tokens=8)
    plain = []
    g = torch.Generator().manual_seed(11)
    st = Row(sp, generator=g)
    for _ in range(20):
        plain.append(int(Sampler()(row, SamplingMetadata.build([st], V, CPU)).sampled_token_ids[0]))
    g2 = torch.Generator().manual_seed(11)
    st2 = Row(sp, generator=g2)
    other = Row(SamplingParams(temperature=0.0, max_tokens=8))
    spec = [_run(torch.cat([row, torch.randn(3, V)]), [st2, other], [[], [1, 2]])[0][0][0]
            for _ in range(20)]
    assert spec == plain


def test_logprob_rows_per_emitted_token():
    rows = torch.randn(3, V)
    rows[0, 4] = rows[1, 5] = 9.0
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    emitted, lp = _run(rows, [Row(sp)], [[4, 5]])
    assert emitted[0][:2] == [4, 5] and len(emitted[0]) == 3
    assert lp is not None and lp.row_start == [0]
    ref = torch.log_softmax(rows, -1)
    for j, tok in enumerate(emitted[0]):
        assert lp.token_ids[j][0] == tok
        assert lp.logprobs[j][0] == pytest.approx(float(ref[j, tok]), abs=1e-5)


# ---- attention for short queries (drafts + bonus) ----------------------------------------

@pytest.mark.parametrize("q_lens", [[1, 3, 5, 9, 2], [2, 1, 1, 4], [9]])
def test_short_query_attention_matches_reference(q_lens):
    from conveyor.kernels.torch_attention import paged_attention_ref, paged_attention_torch

    torch.manual_seed(5)
    bs, hkv, hq, d, num_blocks = 4, 2, 4, 8, 64
    ctx = [7, 0, 13, 30, 2][:len(q_lens)]
    seq = [c + q for c, q in zip(ctx, q_lens)]
    cache = torch.randn(num_blocks, 2, bs, hkv, d)
    table = torch.zeros(len(q_lens), 16, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1) + 1
    for r in range(len(q_lens)):
        table[r] = perm[r * 12:r * 12 + 16] if r * 12 + 16 <= len(perm) else perm[:16]
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    query = torch.randn(int(qsl[-1]), hq, d)
    got = paged_attention_torch(query, cache, table, qsl, np.array(seq), 0.3)
    ref = paged_attention_ref(query, cache, table, qsl, np.array(seq), 0.3)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_proposer_index_misses_allocate_nothing_the_gc_tracks():
    """The proposer runs for every request every step: on text that does not
    repeat, its index must not grow by GC-tracked objects (tuple keys and list
    values made the collector run every few steps of a batch-32 decode)."""
    import gc

    prop = NgramProposer(k=4, n_min=2, n_max=4)
    toks = list(range(3, 203))  # no 2-gram repeats
    assert prop.propose("a", toks, 4) == []
    for t in range(203, 263):
        toks.append(t)
        assert prop.propose("a", toks, 4) == []
    index = prop._index["a"].grams
    assert len(index) == len(toks) - 2  # every gram but the suffix's is indexed
    assert not any(gc.is_tracked(k) or gc.is_tracked(v) for k, v in index.items())
    toks += [5, 6]  # a repeat: 5, 6 occurred at ends 4 and now; drafts what followed
    assert prop.propose("a", toks, 4) == [7, 8, 9, 10]
