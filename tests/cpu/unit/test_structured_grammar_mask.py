"""The worker's grammar-mask application (one byte-table gather and one add)
equals the plain definition: unpack every bit, masked_fill(-inf) per row."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.engine.contracts import GrammarOutput
from conveyor.workers.grammar_mask import apply_grammar_bitmask, mask_penalty, unpack_bitmask_reference


def _random_packed(rng: np.random.Generator, rows: int, words: int) -> np.ndarray:
    return rng.integers(-2**31, 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)


def _reference(logits: torch.Tensor, req_ids: list[str], go: GrammarOutput) -> torch.Tensor:
    out = logits.clone()
    allowed = unpack_bitmask_reference(torch.from_numpy(go.bitmask().copy()), logits.shape[1])
    for m, rid in enumerate(go.structured_output_request_ids):
        if rid in req_ids:
            i = req_ids.index(rid)
            out[i] = out[i].masked_fill(~allowed[m], float("-inf"))
    return out


@pytest.mark.parametrize("width", [96, 90, 100])  # = words*32, fewer columns, more columns
def test_penalty_is_minus_inf_exactly_where_the_bit_is_clear(width):
    packed = torch.from_numpy(_random_packed(np.random.default_rng(width), 5, 3))
    pen = mask_penalty(packed, width, torch.float32)
    assert pen.shape == (5, width)
    assert torch.equal(pen == 0, unpack_bitmask_reference(packed, width))
    assert torch.isneginf(pen[pen != 0]).all()


@pytest.mark.parametrize("layout", ["all_in_order", "permuted", "subset_with_unstructured",
                                    "mask_row_missing_from_batch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_reference(layout, dtype):
    rng = np.random.default_rng(7)
    words, width = 4, 120  # 128 mask bits over 120 logits columns
    ids = [f"r{i}" for i in range(6)]
    go_ids = {"all_in_order": ids, "permuted": [ids[i] for i in (3, 0, 5, 1, 4, 2)],
              "subset_with_unstructured": [ids[4], ids[1]],
              "mask_row_missing_from_batch": [ids[2], "gone", ids[0]]}[layout]
    go = GrammarOutput(go_ids, _random_packed(rng, len(go_ids), words).tobytes(), words)
    logits = torch.randn(len(ids), width).to(dtype)
    want = _reference(logits, ids, go)
    apply_grammar_bitmask(logits, ids, go)
    assert torch.equal(logits, want)
    structured = [i for i, r in enumerate(ids) if r in go_ids]
    untouched = [i for i in range(len(ids)) if i not in structured]
    assert torch.isfinite(logits[untouched]).all()
