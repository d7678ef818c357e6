"""KV tiers on CUDA (tests/gpu/run.sh): the host tier lives in pinned memory
below the GPU pool; a tiny pool makes multi-turn sessions evict, and greedy
fp32 outputs must equal the tier-off run with the host tier and with the disk
tier after a restart (async scheduling and the triton backend, CUDA's
defaults). The worker side round-trips blocks between CUDA caches and pinned
rows, and a corrupted pinned row is reported, never copied.

Skipped unless CUDA is present."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("KV tier GPU tests need CUDA (and TRITON_INTERPRET unset)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for p in (ROOT, os.path.join(ROOT, "tests", "cpu")):
    if p not in sys.path:
        sys.path.insert(0, p)

from llm_utils import make_checkpoint, random_prompts  # noqa: E402

from conveyor.engine import LLM, SamplingParams  # noqa: E402
from conveyor.engine.kv_connector.metadata import TIER_CPU, BlockSave, KVConnectorMetadata, TierLoad  # noqa: E402
from conveyor.engine.kv_connector.spec import TierSpec  # noqa: E402
from conveyor.workers.kv_connector.tiers import TierConnectorWorker  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("gpu_tiers") / "llama"))


def _sessions(ckpt: str, **kw) -> tuple[list[list[int]], list[int]]:
    llm = LLM(model=ckpt, num_gpu_blocks=10, max_model_len=144, block_size=16, **kw)
    sessions = random_prompts(4, 40, 40, seed=3)
    outs, cached = [], []
    try:
        for turn in range(3):
            for i in range(4):
                o = llm.generate([sessions[i]], SP, use_tqdm=False)[0]
                outs.append(list(o.outputs[0].token_ids))
                cached.append(o.num_cached_tokens)
                sessions[i] = sessions[i] + outs[-1] + [5 + turn, 6, 7]
        return outs, cached
    finally:
        llm.shutdown()


def test_host_and_disk_tiers_on_cuda_same_tokens(ckpt, tmp_path):
    off, off_cached = _sessions(ckpt)
    on, on_cached = _sessions(ckpt, offload_cpu_gb=0.001)
    assert on == off and sum(on_cached) > sum(off_cached)
    disk = dict(offload_disk_path=str(tmp_path / "kv"), offload_disk_gb=0.01)
    assert _sessions(ckpt, **disk)[0] == off
    again, again_cached = _sessions(ckpt, **disk)  # a restart: prefixes from disk
    assert again == off and min(again_cached[:4]) >= 32


def test_pinned_round_trip_and_corruption():
    caches = [torch.randn(6, 2, 16, 2, 64, device="cuda") for _ in range(3)]
    bpb = sum(c[0].numel() * c.element_size() for c in caches)
    w = TierConnectorWorker(TierSpec(16, bpb, 2, 0, None, "", 5.0), caches)
    assert w.host is not None and w.host.is_pinned() and w.side is not None  # copies on a side stream
    want = [c[1].clone() for c in caches]
    w.start_load_kv(KVConnectorMetadata(cpu_saves=[BlockSave(b"k", 1, 0)]))
    w.start_load_kv(KVConnectorMetadata(loads=[TierLoad(1, "r", [b"k"], [TIER_CPU], [0], [4])]))
    out = w.get_output()
    assert out is not None and out.invalid_block_ids == []
    assert all(torch.equal(c[4], x) for c, x in zip(caches, want))
    w.host[0, 0] ^= 1
    before = [c[5].clone() for c in caches]
    w.start_load_kv(KVConnectorMetadata(loads=[TierLoad(2, "r", [b"k"], [TIER_CPU], [0], [5])]))
    out = w.get_output()
    assert out is not None and out.invalid_block_ids == [5]
    assert all(torch.equal(c[5], x) for c, x in zip(caches, before))


def test_side_stream_saves_land_before_they_are_read():
    """A save's blocks are gathered before the forward may overwrite them; its
    host row is named only after the copy (next step); a load of a slot saved
    in the same step is recomputed, never read half-written."""
    caches = [torch.randn(8, 2, 16, 2, 64, device="cuda") for _ in range(2)]
    bpb = sum(c[0].numel() * c.element_size() for c in caches)
    w = TierConnectorWorker(TierSpec(16, bpb, 4, 0, None, "", 5.0), caches)
    want = [c[1].clone() for c in caches]
    w.start_load_kv(KVConnectorMetadata(cpu_saves=[BlockSave(b"a", 1, 0)]))
    for c in caches:  # the "forward" overwrites the saved block at once
        c[1].zero_()
    w.start_load_kv(KVConnectorMetadata(cpu_saves=[BlockSave(b"b", 2, 1)],
                                        loads=[TierLoad(1, "r", [b"a"], [TIER_CPU], [0], [6]),
                                               TierLoad(2, "r", [b"b"], [TIER_CPU], [1], [7])]))
    out = w.get_output()
    assert out is not None and sorted(out.finished_loads) == [1, 2] and out.invalid_block_ids == [7]
    assert all(torch.equal(c[6], x) for c, x in zip(caches, want))
