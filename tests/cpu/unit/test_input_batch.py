"""The seed's two-request example through prepare_inputs, and InputBatch upkeep."""
from __future__ import annotations

import numpy as np

from conveyor.engine.sampling_params import SamplingParams
from conveyor.workers.input_batch import CachedRequestState, InputBatch, prepare_inputs


def _state(rid, prompt, blocks, computed=0, outputs=()):
    return CachedRequestState(rid, list(prompt), SamplingParams(), None, list(blocks), computed,
                              list(outputs))


def test_seed_example_step1_and_decode():
    b = InputBatch(max_num_reqs=4, max_model_len=64, block_size=16)
    b.add_request(_state("R1", [10, 11, 12, 13], [1]))
    b.add_request(_state("R2", [20, 21], [2]))
    p = prepare_inputs(b, np.array([4, 2], dtype=np.int32), 16)
    assert p.req_indices.tolist() == [0, 0, 0, 0, 1, 1]
    assert p.query_pos.tolist() == [0, 1, 2, 3, 0, 1]
    assert p.positions.tolist() == [0, 1, 2, 3, 0, 1]
    assert p.input_ids.tolist() == [10, 11, 12, 13, 20, 21]
    assert p.query_start_loc.tolist() == [0, 4, 6]
    assert p.seq_lens.tolist() == [4, 2]
    assert p.slot_mapping.tolist() == [16, 17, 18, 19, 32, 33]
    assert p.logits_indices.tolist() == [3, 5]
    # Sampled R1 -> 100, R2 -> 200; the scheduler reports 4 and 2 computed.
    b.append_token(0, 100)
    b.append_token(1, 200)
    b.num_computed_tokens[:2] = [4, 2]
    prefill_dtypes = [a.dtype for a in vars(p).values()]
    p = prepare_inputs(b, np.array([1, 1], dtype=np.int32), 16)  # the decode path
    assert p.req_indices.tolist() == [0, 1]
    assert p.query_pos.tolist() == [0, 0]
    assert p.positions.tolist() == [4, 2]
    assert p.input_ids.tolist() == [100, 200]
    assert p.query_start_loc.tolist() == [0, 1, 2]
    assert p.seq_lens.tolist() == [5, 3]
    assert p.logits_indices.tolist() == [0, 1]
    assert p.slot_mapping.tolist() == [20, 34]
    assert [a.dtype for a in vars(p).values()] == prefill_dtypes
    b.num_computed_tokens[0] = 0  # positions is a copy: the batch's counters are not aliased
    assert p.positions.tolist() == [4, 2] and p.seq_lens.tolist() == [5, 3]


def test_three_requests_query_pos():
    b = InputBatch(4, 64, 16)
    for i, n in enumerate([2, 5, 3]):
        b.add_request(_state(str(i), range(1, n + 1), [i + 1]))
    p = prepare_inputs(b, np.array([2, 5, 3], dtype=np.int32), 16)
    assert p.req_indices.tolist() == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    assert p.query_pos.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]


def test_remove_and_condense_keep_rows_consistent():
    b = InputBatch(4, 64, 4)
    for i in range(4):
        b.add_request(_state(str(i), [i] * (i + 1), [i + 1, i + 5], computed=i))
    b.remove_request("0")
    b.remove_request("2")
    b.condense()
    assert b.num_reqs == 2 and b.req_ids == ["3", "1"]
    assert b.req_id_to_index == {"3": 0, "1": 1}
    assert b.token_ids[0, :4].tolist() == [3, 3, 3, 3] and b.num_tokens[0] == 4
    assert b.num_computed_tokens[:2].tolist() == [3, 1]
    assert b.block_table.table[0, :2].tolist() == [4, 8]
    b.add_request(_state("x", [7], [9]))
    assert b.req_id_to_index["x"] == 2


def test_row_assignment_independent_of_removal_order():
    """TP ranks free rows in different orders (finished ids come as a set);
    new requests must still land in the same rows on every rank."""
    rows = []
    for order in (["0", "2", "3"], ["3", "0", "2"], ["2", "3", "0"]):
        b = InputBatch(6, 64, 16)
        for i in range(5):
            b.add_request(_state(str(i), [i + 1], [i + 1]))
        for rid in order:
            b.remove_request(rid)
        placed = [b.add_request(_state(x, [9], [9])) for x in ("a", "b")]
        b.condense()
        rows.append((placed, list(b.req_ids)))
    assert rows[0] == rows[1] == rows[2]
