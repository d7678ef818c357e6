"""Applies the core's grammar bitmask to a step's logits, before the sampler
(so penalties, temperature, top-k/p and min-p act on the allowed tokens only)."""
from __future__ import annotations

import numpy as np
import torch

from engine.contracts import GrammarOutput

_BIT = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(packed: torch.Tensor, width: int) -> torch.Tensor:
    """[n, words] int32 -> [n, width] bool; bit j of word w is token 32*w + j.
    Columns past the mask's words (embedding rows beyond the tokenizer) are False."""
    bits = ((packed.unsqueeze(-1) >> _BIT.to(packed.device)) & 1).bool().flatten(1)
    if bits.shape[1] >= width:
        return bits[:, :width]
    pad = torch.zeros(bits.shape[0], width - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def apply_grammar_bitmask(logits: torch.Tensor, req_ids: list[str], go: GrammarOutput,
                          row_offsets: np.ndarray | None = None) -> None:
    """Set disallowed tokens of the structured rows of `logits` to -inf, in place.

    Without row_offsets, logits row i belongs to req_ids[i]. With them (a step
    that verifies drafts), request i owns rows row_offsets[i] .. row_offsets[i+1]
    - 1, one per draft position plus one, and the GrammarOutput carries exactly
    that many rows for it (row j: the mask after its first j drafts)."""
    index = {r: i for i, r in enumerate(req_ids)}
    counts = go.rows_per_request()
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    start = 0
    for r, n in zip(go.structured_output_request_ids, counts):
        i = index.get(r)
        if i is not None:
            first = i if row_offsets is None else int(row_offsets[i])
            have = 1 if row_offsets is None else int(row_offsets[i + 1]) - first
            if n != have:  # the core and the runner disagree on the drafts: a defect
                raise RuntimeError(f"grammar mask for {r!r} has {n} rows, its logits {have}")
            logit_rows.extend(range(first, first + n))
            mask_rows.extend(range(start, start + n))
        start += n
    if not logit_rows:
        return
    rows = torch.tensor(logit_rows, dtype=torch.long, device=logits.device)
    packed = torch.from_numpy(go.bitmask()[mask_rows]).to(logits.device)
    allowed = unpack_bitmask(packed, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
