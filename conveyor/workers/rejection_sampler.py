"""Verifies n-gram drafts: one logits row per draft position plus one (the bonus).

Request i with drafts d_0..d_{k-1} owns rows off_i .. off_i + k. Row off_i + j is
processed exactly as non-speculative sampling would process it if d_0..d_{j-1}
had been sampled (penalties and min_tokens see them as output), so:

- greedy: accept d_j while it equals the row's argmax; the first mismatch's
  argmax (or the bonus row's, if all were accepted) is emitted after them;
- random: the draft distribution is one-hot, so d_j is accepted with
  probability p_j(d_j); on rejection a token is drawn from p_j with d_j's mass
  removed, renormalised (the (p - q)+ residual). The emitted sequence then has
  exactly the distribution of sampling without speculation.

Randomness: every random draft row draws one uniform, then every random row
one [V] exponential vector, whatever the outcome. A seeded request draws them
from its own generator, reseeded from (seed, output position) for each row, so
its tokens never depend on the rest of the batch or on its history; a row without a draft consumes exactly what the plain Sampler
would (one exponential vector, same race on the same unnormalised probs), so
a seeded request gets the same tokens whether or not its batch speculates.
Unseeded rows share one batched draw from the global generator (the same on
every TP rank); a step whose random rows are all seeded makes none (as the
plain Sampler).

A batch whose rows are all plain greedy (no penalties, min_tokens met, no
logprobs) skips the per-row expansion: one argmax over the step's logits.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.engine.contracts import LogprobsLists
from conveyor.engine.sampling_params import SamplingFields
from conveyor.workers.sampler import (
    _GREEDY_EPS,
    _TINY,
    SamplingMetadata,
    SamplingRow,
    gather_logprobs,
    position_seed,
    process_logits,
    random_probs,
    row_argmax,
)


@dataclass
class _DraftRow:
    """A SamplingRow as it would be after the first `j` drafts were sampled."""
    sampling_params: SamplingFields
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_id: int | None


@dataclass
class SpecLayout:
    """Rows of the step's logits: request i's rows start at offsets[i]."""
    drafts: list[list[int]]  # per request, [] when it has none
    offsets: np.ndarray  # [num_reqs + 1]

    @classmethod
    def build(cls, drafts: list[list[int]]) -> SpecLayout:
        offsets = np.zeros(len(drafts) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(d) + 1 for d in drafts])
        return cls(drafts, offsets)

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])

    def logits_indices(self, last_token_index: np.ndarray) -> np.ndarray:
        """Flattened-token indices of every row: the last 1 + k tokens of each request."""
        k = np.array([len(d) for d in self.drafts], dtype=np.int64)
        start = np.repeat(last_token_index.astype(np.int64) - k, k + 1)
        within = np.arange(self.num_rows, dtype=np.int64) - np.repeat(self.offsets[:-1], k + 1)
        return start + within


def expand_rows(states: Sequence[SamplingRow], layout: SpecLayout) -> list[_DraftRow]:
    rows = []
    for st, d in zip(states, layout.drafts):
        for j in range(len(d) + 1):
            out = st.output_token_ids + d[:j] if j else st.output_token_ids
            rows.append(_DraftRow(st.sampling_params, st.prompt_token_ids, out, st.generator,
                                  st.eos_token_id))
    return rows


def _draws(rows: list[_DraftRow], has_draft: list[bool], vocab: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniform [N], exponential [N, V]); see the module doc for the order."""
    num_rows = len(rows)
    seeded = [row.generator is not None and row.sampling_params.temperature >= _GREEDY_EPS
              for row in rows]
    if all(seeded):  # every row draws from its own generator: no batched draw
        u = torch.zeros(num_rows, device=device)  # read only where a row has a draft
        q = torch.empty(num_rows, vocab, device=device)  # every row is overwritten
    else:
        u = torch.rand(num_rows, device=device)
        q = torch.empty(num_rows, vocab, device=device).exponential_()
    for r, row in enumerate(rows):
        if seeded[r]:
            gen, seed = row.generator, row.sampling_params.seed
            assert gen is not None and seed is not None  # seeded rows have both
            # As in the plain sampler: the draws of an output position depend
            # only on (seed, position), never on what was drawn before.
            gen.manual_seed(position_seed(seed, len(row.output_token_ids)))
            if has_draft[r]:
                u[r] = torch.rand((), generator=gen, device=device)
            q[r].exponential_(generator=gen)
    return u, q.clamp_min_(_TINY)


def _verify_rows(x: torch.Tensor, meta: SamplingMetadata, rows: list[_DraftRow],
                 flat_drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (accepted [N] bool, replacement token [N]) where replacement is
    what is emitted if the row's draft is rejected (or the row is a bonus row)."""
    n = x.shape[0]
    draft_tok = torch.tensor(flat_drafts, dtype=torch.int64, device=x.device)
    has_draft = draft_tok >= 0
    safe = draft_tok.clamp_min(0).unsqueeze(1)
    accept = torch.zeros(n, dtype=torch.bool, device=x.device)
    token = torch.zeros(n, dtype=torch.int64, device=x.device)
    if not meta.all_random:
        g = row_argmax(x)
        accept, token = has_draft & (draft_tok == g), g
    if meta.all_greedy:
        return accept, token
    probs = random_probs(x, meta)  # unnormalised after min-p: the race does not mind
    u, q = _draws(rows, [t >= 0 for t in flat_drafts], x.shape[1], x.device)
    p_draft = probs.gather(1, safe).squeeze(1)
    r_accept = has_draft & (u * probs.sum(dim=-1) < p_draft)
    # Rejected: the residual (p - onehot(d))+ is p with d removed.
    residual = probs.scatter(1, safe, torch.where(has_draft, 0.0, p_draft).unsqueeze(1))
    r_token = row_argmax(residual / q)
    if meta.all_random:
        return r_accept, r_token
    assert meta.greedy_mask is not None
    return (torch.where(meta.greedy_mask, accept, r_accept),
            torch.where(meta.greedy_mask, token, r_token))


def _argmax_only(states: Sequence[SamplingRow]) -> bool:
    """Every row's processing is a bare argmax: greedy, no penalties, no
    logit_bias / allowed_token_ids, min_tokens already met (so at every draft
    position too), no logprobs."""
    for st in states:
        p = st.sampling_params
        if (p.temperature >= _GREEDY_EPS or p.logprobs is not None or p.repetition_penalty != 1.0
                or p.frequency_penalty or p.presence_penalty
                or p.logit_bias or p.allowed_token_ids is not None
                or len(st.output_token_ids) < p.min_tokens):
            return False
    return True


def _verify_argmax(logits: torch.Tensor, layout: SpecLayout) -> list[list[int]]:
    """Greedy verification without the per-row metadata: accept while each
    draft equals its row's argmax, then that row's argmax (the plain
    Sampler's argmax of the same fp32 logits)."""
    g = row_argmax(logits.float()).tolist()
    emitted = []
    for off, d in zip(layout.offsets.tolist(), layout.drafts):
        a = 0
        while a < len(d) and g[off + a] == d[a]:
            a += 1
        emitted.append([*d[:a], g[off + a]])
    return emitted


def sample_with_drafts(logits: torch.Tensor, states: Sequence[SamplingRow], layout: SpecLayout,
                       vocab_size: int, device: torch.device
                       ) -> tuple[list[list[int]], LogprobsLists | None]:
    """Tokens emitted per request (accepted drafts, then one more) and, when
    asked for, one logprobs row per emitted token (LogprobsLists.row_start)."""
    if _argmax_only(states):
        return _verify_argmax(logits, layout), None
    rows = expand_rows(states, layout)
    meta = SamplingMetadata.build(rows, vocab_size, device)
    x, raw_logprobs = process_logits(logits, meta)
    flat = [t for d in layout.drafts for t in (*d, -1)]
    accept, token = _verify_rows(x, meta, rows, flat)
    accept_np, token_np = accept.cpu().numpy(), token.cpu().numpy()
    emitted: list[list[int]] = []
    per_row = token_np.copy()  # the token each row emits (if it is reached)
    for i, d in enumerate(layout.drafts):
        off = int(layout.offsets[i])
        a = 0
        while a < len(d) and accept_np[off + a]:
            per_row[off + a] = d[a]
            a += 1
        emitted.append(list(d[:a]) + [int(token_np[off + a])])
    if raw_logprobs is None:
        return emitted, None
    assert meta.max_num_logprobs is not None
    ids, lps, ranks = gather_logprobs(raw_logprobs, torch.from_numpy(per_row).to(device),
                                      meta.max_num_logprobs)
    return emitted, LogprobsLists(ids.tolist(), lps.tolist(), ranks.tolist(),
                                  row_start=layout.offsets[:-1].tolist())
