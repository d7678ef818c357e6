"""Decode CUDA graphs without CUDA: the capture sizes, the padding, the
persistent buffers and the refusals, with a capturer that records the
forward's aten calls once and replays those same calls (the host values it saw
at capture baked in, as a CUDA graph bakes them) on the same buffers."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from conveyor.engine.config import build_config
from conveyor.kernels.backends import AttentionMetadata
from conveyor.workers.cuda_graphs import DecodeGraphRunner, capture_sizes, graphs_refused, padded_size

BS, D = 4, 8


class RecordingCapturer:
    """A fake CUDA graph: replay re-runs the recorded aten calls with every
    tensor argument the capture made replaced by its replay counterpart;
    tensors from outside (persistent buffers, weights, the KV cache) are the
    same objects, so in-place writes land where a graph's would."""

    def __init__(self) -> None:
        self.num_captures = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        ops: list[tuple] = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                ops.append((func, args, kwargs or {}, out))
                return out

        with Record():
            result = fn()
        self.num_captures += 1

        def replay() -> torch.Tensor:
            env: dict[int, torch.Tensor] = {}
            sub = lambda x: env.get(id(x), x) if isinstance(x, torch.Tensor) else x  # noqa: E731
            for func, args, kwargs, cap_out in ops:
                new = func(*tree_map(sub, args), **tree_map(sub, kwargs))
                for c, r in zip(tree_flatten(cap_out)[0], tree_flatten(new)[0]):
                    if isinstance(c, torch.Tensor):
                        env[id(c)] = r
            return env.get(id(result), result)
        return replay


def toy_forward(kv: torch.Tensor, emb: torch.Tensor, host_values: bool = False):
    """Paged-attention-shaped work on device tensors only: write each token's
    row at its slot (skipping slot -1), then average the context through the
    block table up to seq_len."""
    def forward(meta: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = emb[ids] + pos[:, None].to(emb.dtype)
        cache = kv.view(-1, D)
        valid = meta.slot_mapping >= 0
        slots = torch.where(valid, meta.slot_mapping, 0)
        cache.index_copy_(0, slots, torch.where(valid[:, None], x, cache[slots]))
        p = torch.arange(meta.block_table.shape[1] * BS)
        ctx = cache[meta.block_table[:, p // BS].long() * BS + p % BS]
        lens = torch.from_numpy(meta.seq_lens_cpu) if host_values else meta.seq_lens
        mask = (p[None, :] < lens[:, None]).to(x.dtype)
        return (ctx * mask[..., None]).sum(1) / lens[:, None] + x
    return forward


def _step(rng: np.random.Generator, n: int, num_blocks: int, max_blocks: int):
    """n decode rows with disjoint blocks (none is the null block 0)."""
    seq_lens = rng.integers(1, max_blocks * BS + 1, n).astype(np.int32)
    blocks = rng.permutation(np.arange(1, num_blocks))[:n * max_blocks].reshape(n, max_blocks)
    pos = (seq_lens - 1).astype(np.int64)
    slots = blocks[np.arange(n), pos // BS].astype(np.int64) * BS + pos % BS
    ids = rng.integers(0, 50, n).astype(np.int64)
    return ids, pos, slots, seq_lens, blocks.astype(np.int32)


def _eager(fwd, ids, pos, slots, seq_lens, bt) -> torch.Tensor:
    n = len(seq_lens)
    meta = AttentionMetadata(torch.from_numpy(slots), torch.arange(n + 1, dtype=torch.int32),
                             torch.from_numpy(seq_lens), torch.from_numpy(bt), 1,
                             int(seq_lens.max()), np.arange(n + 1, dtype=np.int32), seq_lens)
    return fwd(meta, torch.from_numpy(ids), torch.from_numpy(pos))


def test_capture_sizes_and_padding():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(20) == [1, 2, 4, 8, 16] and capture_sizes(3) == [1, 2]
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 9, 16, 17, 33, 64, 65)] == \
        [1, 2, 4, 8, 16, 16, 32, 48, 64, None]


@pytest.mark.parametrize("host_values", [False, True])
def test_graph_replay_matches_eager(host_values):
    """Padded replays equal the eager forward row for row and leave the same
    KV cache; inputs go through the same buffers every step; and a forward
    that reads host values (what the torch/cpu backends do) goes stale under
    replay, which is why graphs_refused turns those backends away."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    num_blocks, max_blocks = 200, 4
    emb = torch.randn(50, D)
    kv_graph, kv_eager = torch.randn(num_blocks, BS, D), None
    kv_graph[0] = 0
    kv_eager = kv_graph.clone()
    cap = RecordingCapturer()
    runner = DecodeGraphRunner(toy_forward(kv_graph, emb, host_values), capture_sizes(32), max_blocks,
                               max_blocks * BS, torch.device("cpu"), cap)
    runner.capture_all()
    assert cap.num_captures == 6 and torch.equal(kv_graph[1:], kv_eager[1:])  # capture wrote nothing
    ptrs = [t.data_ptr() for t in (runner.input_ids, runner.slot_mapping, runner.block_table)]
    stale = False
    for n in (1, 3, 5, 16, 17, 2):
        step = _step(rng, n, num_blocks, max_blocks)
        got = runner.run(*step)
        want = _eager(toy_forward(kv_eager, emb, host_values), *step)
        assert got.shape == want.shape == (n, D)
        if host_values:
            stale |= not torch.allclose(got, want)
        else:
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(kv_graph, kv_eager)  # padding rows wrote no KV
    assert [t.data_ptr() for t in (runner.input_ids, runner.slot_mapping, runner.block_table)] == ptrs
    assert stale == host_values
    assert runner.run(*_step(rng, 33, num_blocks, max_blocks)) is None  # past 32: eager


def test_graphs_refused():
    cfg = build_config(max_model_len=64)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert graphs_refused(cfg, cuda, "triton") is None
    assert "CUDA" in graphs_refused(cfg, cpu, "triton")
    assert "host values" in graphs_refused(cfg, cuda, "torch")
    assert "enforce_eager" in graphs_refused(build_config(max_model_len=64, enforce_eager=True), cuda, "triton")
    spec = build_config(max_model_len=64, speculative_config={"method": "ngram"})
    assert "speculative" in graphs_refused(spec, cuda, "triton")
