"""The fused mixture-of-experts layer against the dense reference (every token
through every expert, weighted by the router), the routing rule, the expert
split over ranks, and its refusals."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module import

import pytest
import torch
from torch import nn

from conveyor.parallel import layers, state
from conveyor.workers.layers.moe import FusedMoE, MoEShape, dense_reference, route_topk

SHAPE = MoEShape(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24)


def _layer(shape: MoEShape = SHAPE, expert_parallel: bool = False) -> FusedMoE:
    layer = FusedMoE(shape, torch.float32, expert_parallel)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(layer.w13_weight.shape, generator=g) * 0.2)
        layer.w2_weight.copy_(torch.randn(layer.w2_weight.shape, generator=g) * 0.2)
    return layer


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_fused_equals_dense_reference(rows: int) -> None:
    layer = _layer()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, SHAPE.hidden_size, generator=g)
    weights, ids = route_topk(torch.randn(rows, SHAPE.num_experts, generator=g), SHAPE.top_k, True)
    got = layer(x, weights, ids)
    ref = dense_reference(x, layer.w13_weight, layer.w2_weight, weights, ids)
    assert got.shape == (rows, SHAPE.hidden_size)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_prefill_experts_gather_their_onednn_rows_bit_for_bit() -> None:
    """Above 64 rows an fp32 expert's gather repeats a token up to oneDNN's
    bucket instead of padding with zeros: the kept rows' bits are those of
    the zero-padded linears."""
    layer = _layer()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(400, SHAPE.hidden_size, generator=g)
    weights, ids = route_topk(torch.randn(400, SHAPE.num_experts, generator=g), SHAPE.top_k, True)
    counts = torch.bincount(ids.reshape(-1), minlength=SHAPE.num_experts)
    assert int(counts.min()) > 64 and any(layers.onednn_rows(int(n)) != int(n) for n in counts)
    want = torch.zeros_like(x)
    for e in range(SHAPE.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = layers.linear(nn.Module(), x[tok], layer.w13_weight[e])
        y = layers.linear(nn.Module(), layer.act(h), layer.w2_weight[e])
        want.index_add_(0, tok, y * weights[tok, slot][:, None])
    assert torch.equal(layer(x, weights, ids), want)


def test_route_topk_is_softmax_then_topk() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route_topk(logits, 2, renormalize=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, p[:, :2])
    w, _ = route_topk(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(-1), torch.ones(1)) and w.dtype == torch.float32


def test_expert_parallel_ranks_sum_to_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks of an expert-parallel layer each hold half the experts; their
    partial outputs sum to the one-rank layer's (the all-reduce's job)."""
    whole = _layer()
    x = torch.randn(7, SHAPE.hidden_size, generator=torch.Generator().manual_seed(3))
    weights, ids = route_topk(torch.randn(7, SHAPE.num_experts), SHAPE.top_k, True)
    parts = []
    for rank in range(2):
        monkeypatch.setattr(state, "tp_size", lambda: 2)
        monkeypatch.setattr(state, "tp_rank", lambda r=rank: r)
        layer = FusedMoE(SHAPE, torch.float32, expert_parallel=True)
        assert (layer.num_local, layer.first_expert) == (4, 4 * rank)
        with torch.no_grad():
            layer.w13_weight.copy_(whole.w13_weight[4 * rank:4 * rank + 4])
            layer.w2_weight.copy_(whole.w2_weight[4 * rank:4 * rank + 4])
        parts.append(layer(x, weights, ids))
    torch.testing.assert_close(parts[0] + parts[1], whole(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_uneven_expert_split_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "tp_size", lambda: 3)
    monkeypatch.setattr(state, "tp_rank", lambda: 0)
    with pytest.raises(ValueError, match="num_experts 8 is not a multiple of tensor_parallel_size 3"):
        FusedMoE(SHAPE, torch.float32, expert_parallel=True)


def test_lora_on_the_experts_is_refused(tmp_path) -> None:
    """An adapter on a mixture-of-experts model may target attention only:
    one naming an MLP projection fails its check (a 400 at the edge)."""
    import json

    from conveyor.engine.lora import ModelDims, check_adapter

    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}))
    dims = ModelDims.from_hf_config({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                     "num_hidden_layers": 2, "num_experts": 8})
    assert dims.moe
    with pytest.raises(ValueError, match=r"\['down_proj'\] not supported on a mixture-of-experts model"):
        check_adapter(str(tmp_path), 16, dims)


@pytest.mark.parametrize(("rows", "first_expert", "num_local"), [(1, 0, 8), (19, 0, 8), (19, 4, 4)])
def test_triton_grouped_gemm_equals_dense_reference(rows: int, first_expert: int, num_local: int) -> None:
    """The GPU path (conveyor/kernels/fused_moe.py) under the interpreter, fp32:
    all experts, and an expert-parallel rank's half (other experts' pairs stay 0)."""
    pytest.importorskip("triton")
    from conveyor.kernels.fused_moe import align_pairs, fused_moe

    whole = _layer()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, SHAPE.hidden_size, generator=g)
    weights, ids = route_topk(torch.randn(rows, SHAPE.num_experts, generator=g), SHAPE.top_k, True)
    sl = slice(first_expert, first_expert + num_local)
    got = fused_moe(x, whole.w13_weight[sl].contiguous(), whole.w2_weight[sl].contiguous(), weights, ids,
                    first_expert)
    mine = (ids >= first_expert) & (ids < first_expert + num_local)
    ref = dense_reference(x, whole.w13_weight, whole.w2_weight, weights * mine, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    sorted_ids, blocks = align_pairs(ids, SHAPE.num_experts)
    assert sorted_ids.numel() == blocks.numel() * 16 and sorted(sorted_ids[sorted_ids < rows * 2].tolist()) \
        == list(range(rows * 2))
