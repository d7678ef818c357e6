"""Applies the core's grammar bitmask to a step's logits, before the sampler
(so penalties, temperature, top-k/p and min-p act on the allowed tokens only).

The mask is turned into 0 / -inf penalties with one table lookup per byte
(bytes of the little-endian int32 words, in token order) and added to the
logits in place (index_add_ for scattered rows): a handful of torch ops per
step whatever the batch, instead of bit shifts over a [rows, words, 32] tensor
plus a gather, a masked_fill and a scatter of the logits rows.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from conveyor.engine.contracts import GrammarOutput

# The core packs bit j of word w as token 32*w + j; read as bytes, byte k of
# the row holds tokens 8k .. 8k+7 only on a little-endian host.
if sys.byteorder != "little":
    raise ImportError("grammar bitmask unpacking assumes a little-endian host")

_BIT = torch.arange(32, dtype=torch.int32)
# _PENALTY[b, j]: 0.0 if bit j of byte b is set (token allowed), else -inf.
_PENALTY = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 1, 0.0, float("-inf"))
_PENALTY_ON: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def unpack_bitmask_reference(packed: torch.Tensor, width: int) -> torch.Tensor:
    """[n, words] int32 -> [n, width] bool allowed; bit j of word w is token 32*w + j.
    Columns past the mask's words (embedding rows beyond the tokenizer) are False.
    The plain definition that mask_penalty must agree with."""
    bits = ((packed.unsqueeze(-1) >> _BIT.to(packed.device)) & 1).bool().flatten(1)
    if bits.shape[1] >= width:
        return bits[:, :width]
    pad = torch.zeros(bits.shape[0], width - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def mask_penalty(packed: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, words] int32 (contiguous) -> [n, width] of 0 (allowed) or -inf (not,
    columns past the mask's words included): one gather from a byte table."""
    key = (packed.device, dtype)
    table = _PENALTY_ON.get(key)
    if table is None:
        table = _PENALTY_ON.setdefault(key, _PENALTY.to(packed.device, dtype))
    n = packed.shape[0]
    pen = table.index_select(0, packed.view(torch.uint8).view(-1).int()).view(n, -1)
    if pen.shape[1] >= width:
        return pen[:, :width]
    pad = torch.full((n, width - pen.shape[1]), float("-inf"), dtype=dtype, device=pen.device)
    return torch.cat([pen, pad], dim=1)


def _rows_to_mask(req_ids: list[str], go: GrammarOutput,
                  row_offsets: np.ndarray | None) -> tuple[list[int], list[int]]:
    """(logits rows, mask rows) of the structured requests present in req_ids."""
    index = {r: i for i, r in enumerate(req_ids)}
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    start = 0
    for r, n in zip(go.structured_output_request_ids, go.rows_per_request()):
        i = index.get(r)
        if i is not None:
            first = i if row_offsets is None else int(row_offsets[i])
            have = 1 if row_offsets is None else int(row_offsets[i + 1]) - first
            if n != have:  # the core and the runner disagree on the drafts: a defect
                raise RuntimeError(f"grammar mask for {r!r} has {n} rows, its logits {have}")
            logit_rows.extend(range(first, first + n))
            mask_rows.extend(range(start, start + n))
        start += n
    return logit_rows, mask_rows


def apply_grammar_bitmask(logits: torch.Tensor, req_ids: list[str], go: GrammarOutput,
                          row_offsets: np.ndarray | None = None) -> None:
    """Set disallowed tokens of the structured rows of `logits` to -inf, in place.

    Without row_offsets, logits row i belongs to req_ids[i]. With them (a step
    that verifies drafts), request i owns rows row_offsets[i] .. row_offsets[i+1]
    - 1, one per draft position plus one, and the GrammarOutput carries exactly
    that many rows for it (row j: the mask after its first j drafts)."""
    logit_rows, mask_rows = _rows_to_mask(req_ids, go, row_offsets)
    if not logit_rows:
        return
    n, width = len(logit_rows), logits.shape[1]
    identity = list(range(n))
    if mask_rows == identity and n * go.num_words * 4 == len(go.grammar_bitmask):
        # Every mask row, in order: no gather. bytearray: a writable copy
        # (torch warns on wrapping read-only bytes).
        packed = torch.frombuffer(bytearray(go.grammar_bitmask), dtype=torch.int32).view(n, -1)
    else:
        packed = torch.from_numpy(go.bitmask()[mask_rows])
    # Adding 0 / -inf equals masked_fill(-inf) for every finite logit (and NaN
    # stays NaN either way); one add (or index_add for scattered rows) instead
    # of a gather, a fill and a scatter.
    pen = mask_penalty(packed.to(logits.device), width, logits.dtype)
    if logit_rows == identity:  # logits rows 0..n-1 in order: add in place
        logits[:n].add_(pen)
        return
    rows = torch.tensor(logit_rows, dtype=torch.long, device=logits.device)
    logits.index_add_(0, rows, pen)
