"""Prompt logprobs on the last PP stage, one prefill chunk at a time.

For a request with prompt_logprobs=k whose chunk covers positions
[start, start + n), the hidden state at position p predicts prompt token
p + 1, so the chunk yields the logprobs of positions start + 1 .. min(start + n,
P - 1) (P: prompt length; position P - 1's hidden state predicts the first
output token and goes to the sampler as usual).

Memory: logits are computed for at most ROWS_PER_PASS positions at a time and
only the top-k plus the prompt token's own logprob leave the device, so the
peak is ROWS_PER_PASS x vocab fp32 whatever the prompt or chunk length
(vLLM #38830 ran out of memory holding a whole prompt's logits).

Every TP rank of the last stage runs this (compute_logits gathers over TP, a
collective): all of them see the same requests, so they make the same passes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from conveyor.engine.contracts import PromptLogprobs
from conveyor.workers.input_batch import CachedRequestState

# Positions whose logits are materialised at once (bounds the extra memory).
ROWS_PER_PASS = 256


def _plan(states: Sequence[CachedRequestState], computed: np.ndarray, num_sched: np.ndarray,
          query_start: np.ndarray) -> tuple[list[tuple[str, int, int]], list[int], list[int], list[int]]:
    """(req_id, first position, rows) per request, then the flat hidden-state
    index, the target token and the request's k of every row."""
    reqs: list[tuple[str, int, int]] = []
    flat: list[int] = []
    targets: list[int] = []
    ks: list[int] = []
    for i, st in enumerate(states):
        k = st.sampling_params.prompt_logprobs
        # Output tokens exist only once the prompt logprobs were sent (they go
        # out with the first token): a recompute needs none.
        if k is None or st.output_token_ids:
            continue
        start = int(computed[i])
        end = min(start + int(num_sched[i]), len(st.prompt_token_ids) - 1)
        if end <= start:
            continue
        q0 = int(query_start[i])
        reqs.append((st.req_id, start + 1, end - start))
        flat.extend(range(q0, q0 + end - start))
        targets.extend(st.prompt_token_ids[start + 1:end + 1])
        ks.append(k)
    return reqs, flat, targets, ks


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            hidden: torch.Tensor, states: Sequence[CachedRequestState],
                            computed: np.ndarray, num_sched: np.ndarray,
                            query_start: np.ndarray) -> dict[str, PromptLogprobs] | None:
    """This step's prompt logprobs per request, or None when no row asks.
    computed[i]: row i's computed tokens before this step; num_sched[i]: its
    tokens this step, whose hidden states start at query_start[i]."""
    reqs, flat, targets, ks = _plan(states, computed, num_sched, query_start)
    if not reqs:
        return None
    max_k = max(ks)
    dev = hidden.device
    index = torch.tensor(flat, dtype=torch.int64, device=dev)
    target = torch.tensor(targets, dtype=torch.int64, device=dev)
    ids_rows: list[list[int]] = []
    lp_rows: list[list[float]] = []
    for lo in range(0, len(flat), ROWS_PER_PASS):
        hi = min(lo + ROWS_PER_PASS, len(flat))
        logprobs = torch.log_softmax(compute_logits(hidden[index[lo:hi]]).float(), dim=-1)
        col = target[lo:hi].unsqueeze(1)
        ids, lps = col, logprobs.gather(1, col)
        k = min(max_k, logprobs.shape[-1])
        if k:
            top_lp, top_ids = logprobs.topk(k, dim=-1)
            ids, lps = torch.cat([ids, top_ids], dim=1), torch.cat([lps, top_lp], dim=1)
        ids_rows.extend(ids.tolist())
        lp_rows.extend(lps.tolist())
    out: dict[str, PromptLogprobs] = {}
    row = 0
    for (rid, first, n), k in zip(reqs, ks):
        out[rid] = PromptLogprobs(first, [r[:k + 1] for r in ids_rows[row:row + n]],
                                  [r[:k + 1] for r in lp_rows[row:row + n]])
        row += n
    return out
