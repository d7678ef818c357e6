"""Applies the core's grammar bitmask to a step's logits, before the sampler
(so penalties, temperature, top-k/p and min-p act on the allowed tokens only)."""
from __future__ import annotations

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


def apply_grammar_bitmask(logits: torch.Tensor, req_ids: list[str], go: GrammarOutput) -> None:
    """Set disallowed tokens of the structured rows of `logits` to -inf, in place."""
    index = {r: i for i, r in enumerate(req_ids)}
    pairs = [(index[r], k) for k, r in enumerate(go.structured_output_request_ids) if r in index]
    if not pairs:
        return
    rows = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=logits.device)
    packed = torch.from_numpy(go.bitmask()[[p[1] for p in pairs]]).to(logits.device)
    allowed = unpack_bitmask(packed, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
