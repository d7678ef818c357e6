"""KV tiers below the paged pool, end to end on a tiny Llama (greedy, fp32).

Multi-turn sessions outgrow a 10-block pool, so every later turn's prefix has
been evicted from the pool by the time it comes back. With the host tier,
the disk tier, both, or a restarted engine on the same disk folder, every
output must equal the tier-off run token for token, while the tiers supply
prefix tokens the pool alone no longer has; corrupted tier bytes must be
detected and recomputed with the same output.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from llm_utils import random_prompts

from conveyor import LLM, SamplingParams
from conveyor.engine.core.engine_core import EngineCore
from conveyor.workers.kv_connector.block_io import BlockCodec
from conveyor.workers.kv_connector.disk_io import DiskIO
from conveyor.workers.kv_connector.tiers import TierConnectorWorker

SESSIONS, TURNS = 4, 3
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _core(llm: LLM) -> EngineCore:
    core = llm.engine
    assert isinstance(core, EngineCore), type(core)
    return core


def _run(path: str, before_turn=None, **kw) -> tuple[list[list[int]], list[int], dict[str, float]]:  # type: ignore[no-untyped-def]
    """Each session's turns one after another: the next turn's prompt is the
    last prompt + its output + 3 new tokens. Returns (outputs, cached tokens, metrics)."""
    llm = LLM(model=path, num_gpu_blocks=10, max_model_len=144, block_size=16, **kw)
    sessions = random_prompts(SESSIONS, 40, 40, seed=3)
    outs, cached = [], []
    try:
        for turn in range(TURNS):
            if before_turn is not None:
                before_turn(llm, turn)
            for i in range(SESSIONS):
                o = llm.generate([sessions[i]], SP, use_tqdm=False)[0]
                outs.append(list(o.outputs[0].token_ids))
                cached.append(o.num_cached_tokens)
                sessions[i] = sessions[i] + outs[-1] + [5 + turn, 6, 7]
        return outs, cached, llm.get_metrics()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tier_off(tiny_llama: str) -> tuple[list[list[int]], list[int], dict[str, float]]:
    return _run(tiny_llama)


def _reused(m: dict[str, float], source: str) -> float:
    return m.get(f'conveyor_kv_reused_tokens_total{{source="{source}"}}', 0.0)


def test_host_tier_same_tokens_and_more_reuse(tiny_llama, tier_off):
    outs, cached, m = _run(tiny_llama, offload_cpu_gb=0.001)
    assert outs == tier_off[0]
    # The pool alone lost most prefixes; the host tier brought them back.
    assert sum(cached) > sum(tier_off[1]) + 100, (cached, tier_off[1])
    assert _reused(m, "cpu") > 0 and m.get("conveyor_kv_transfer_failures_total", 0) == 0


def test_tier_miss_only_same_tokens(tiny_llama, tier_off):
    """A host tier too small for a single block: every lookup misses."""
    outs, cached, _ = _run(tiny_llama, offload_cpu_gb=1e-9)
    assert outs == tier_off[0] and cached == tier_off[1]


def _corrupt_host_tier(llm: LLM, turn: int) -> None:
    conn = _core(llm).executor.worker.model_runner.kv_connector
    if turn > 0:
        assert conn is not None and conn.host is not None
        conn.host.bitwise_not_()  # every stored byte flipped: each block fails its crc32


def test_corrupted_host_tier_detected_and_recomputed(tiny_llama, tier_off):
    outs, cached, m = _run(tiny_llama, before_turn=_corrupt_host_tier, offload_cpu_gb=0.001)
    assert outs == tier_off[0]
    assert m.get("conveyor_kv_transfer_failures_total", 0) > 0


def test_disk_tier_survives_a_restart(tiny_llama, tier_off, tmp_path):
    disk = dict(offload_disk_path=str(tmp_path / "kv"), offload_disk_gb=0.01)
    first = _run(tiny_llama, **disk)
    assert first[0] == tier_off[0] and _reused(first[2], "disk") > 0
    # A new engine on the same folder: the first turn's prefixes come from disk.
    again = _run(tiny_llama, **disk)
    assert again[0] == tier_off[0]
    assert all(c >= 32 for c in again[1][:SESSIONS]), again[1]
    both = _run(tiny_llama, offload_cpu_gb=0.0005, **disk)
    assert both[0] == tier_off[0]


def _corrupt_disk_files(folder: Path) -> int:
    n = 0
    for p in folder.rglob("*.kvb"):
        data = bytearray(p.read_bytes())
        data[-5] ^= 0xFF  # one payload byte: only the crc32 can tell
        p.write_bytes(bytes(data))
        n += 1
    return n


def test_corrupted_disk_tier_detected_and_recomputed(tiny_llama, tier_off, tmp_path):
    disk = dict(offload_disk_path=str(tmp_path / "kv"), offload_disk_gb=0.01)
    _run(tiny_llama, **disk)
    assert _corrupt_disk_files(tmp_path / "kv") > 0
    (next((tmp_path / "kv").iterdir()) / ("ab" * 32 + ".kvb")).write_bytes(b"not a block")
    outs, cached, m = _run(tiny_llama, **disk)
    assert outs == tier_off[0]
    assert m.get("conveyor_kv_transfer_failures_total", 0) > 0


def test_disk_files_are_whole_and_bounded(tiny_llama, tmp_path):
    """LRU by size: a 3-block disk tier keeps at most 3 files, none temporary."""
    folder = tmp_path / "kv"
    bpb = _bytes_per_block(tiny_llama)
    _run(tiny_llama, offload_disk_path=str(folder), offload_disk_gb=3.5 * bpb / (1 << 30))
    files = [p for d in folder.iterdir() for p in d.iterdir()]
    assert 0 < len(files) <= 3 and all(p.suffix == ".kvb" for p in files), files
    assert all(os.path.getsize(p) > bpb for p in files)


def _bytes_per_block(path: str) -> int:
    llm = LLM(model=path, num_gpu_blocks=10, max_model_len=144, block_size=16)
    try:
        return _core(llm).kv_info.bytes_per_block
    finally:
        llm.shutdown()


def test_late_disk_loads_are_recomputed_not_waited_for(tiny_llama, tier_off, tmp_path, monkeypatch):
    """Every disk read outlasts kv_load_timeout_s: requests recompute and finish."""
    disk = dict(offload_disk_path=str(tmp_path / "kv"), offload_disk_gb=0.01)
    _run(tiny_llama, **disk)
    slow_read = DiskIO._read
    monkeypatch.setattr(DiskIO, "_read", lambda self, key: (time.sleep(0.2), slow_read(self, key))[1])
    outs, cached, m = _run(tiny_llama, kv_load_timeout_s=0.05, **disk)
    assert outs == tier_off[0]
    assert m.get("conveyor_kv_transfer_failures_total", 0) > 0 and _reused(m, "disk") == 0


def test_a_transfer_error_fails_its_blocks_not_the_engine(tiny_llama, tier_off, monkeypatch):
    def broken(self, rows, block_ids):
        raise RuntimeError("DMA error")

    monkeypatch.setattr(BlockCodec, "scatter", broken)  # every load into the pool fails
    outs, cached, m = _run(tiny_llama, offload_cpu_gb=0.001)
    assert outs == tier_off[0]
    assert m.get("conveyor_kv_transfer_failures_total", 0) > 0 and _reused(m, "cpu") == 0


@pytest.mark.parametrize("extra", [{"async_scheduling": "on"}, {"executor": "mp"}], ids=["async", "mp"])
def test_host_tier_with_async_scheduling_and_a_worker_process(tiny_llama, tier_off, extra):
    """Steps planned while the last one runs; a worker in its own process
    (metadata and reports through msgspec)."""
    outs, cached, m = _run(tiny_llama, offload_cpu_gb=0.001, **extra)
    assert outs == tier_off[0] and _reused(m, "cpu") > 0


class _Layerwise(TierConnectorWorker):
    """The tier connector declared layerwise, recording the seed's per-layer hooks."""
    layerwise = True

    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.calls: list[tuple[str, int]] = []

    def wait_for_layer_load(self, layer: int) -> None:
        self.calls.append(("load", layer))

    def save_kv_layer(self, layer: int, kv_cache) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("save", layer))


def test_layerwise_hooks_wrap_every_attention_layer(tiny_llama, tier_off):
    llm = LLM(model=tiny_llama, num_gpu_blocks=10, max_model_len=144, block_size=16, offload_cpu_gb=0.001)
    try:
        runner = _core(llm).executor.worker.model_runner
        old = runner.kv_connector
        old.close()
        runner.kv_connector = conn = _Layerwise(old.spec, runner.kv_caches)
        out = llm.generate(random_prompts(SESSIONS, 40, 40, seed=3)[:1], SP, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert list(out.outputs[0].token_ids) == tier_off[0][0]
    per_forward = [(k, i) for i in range(len(runner.kv_caches)) for k in ("load", "save")]
    assert conn.calls == per_forward * SP.max_tokens  # one prefill step + one per later token


def test_router_follows_prefixes_into_the_tiers(tiny_llama, tier_off):
    """Two engines behind the kv_aware router, pools too small to keep a
    session's history: the tiers' keys reach the router, so every later turn
    goes where its prefix is (a cache hit, the same engine as the turn before)
    and reuses it; the tokens stay the tier-off run's."""
    picks: list[list[int]] = [[] for _ in range(SESSIONS)]
    reasons: list[str] = []

    def spy(llm: LLM, turn: int) -> None:
        router = llm.engine.client.router  # type: ignore[attr-defined]
        if getattr(router, "_spied", False):
            return
        route = router.route

        def recorded(request_id, hashes, *a, **kw):  # type: ignore[no-untyped-def]
            d = route(request_id, hashes, *a, **kw)
            picks[len(reasons) % SESSIONS].append(d.engine)
            reasons.append(d.reason)
            return d

        router.route, router._spied = recorded, True

    outs, cached, m = _run(tiny_llama, before_turn=spy, data_parallel_size=2, offload_cpu_gb=0.001)
    assert outs == tier_off[0]
    assert all(r == "cache_hit" for r in reasons[SESSIONS:]), reasons
    assert all(len(set(p)) == 1 for p in picks), picks
    assert sum(cached) > sum(tier_off[1])


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_tiers_on_several_ranks(tiny_llama, tmp_path, layout):
    """Each rank keeps its shard of every tier block (host rows, a disk folder
    per rank); the engine uses a block only once every rank loaded it. Same
    tokens as the same layout with the tiers off, before and after a restart
    from disk."""
    kw = dict(executor="mp", **layout)
    off = _run(tiny_llama, **kw)
    disk = dict(offload_disk_path=str(tmp_path / "kv"), offload_disk_gb=0.01)
    on = _run(tiny_llama, offload_cpu_gb=0.0005, **disk, **kw)
    assert on[0] == off[0]
    assert _reused(on[2], "cpu") > 0 and sum(on[1]) > sum(off[1])
    ranks = sorted(p.name for p in next((tmp_path / "kv").iterdir()).iterdir())
    assert ranks == ["rank0", "rank1"]
    again = _run(tiny_llama, **disk, **kw)  # a new engine: the first turn's prefixes from disk
    assert again[0] == off[0]
    assert all(c >= 32 for c in again[1][:SESSIONS]), again[1]
    # Rank 0's shards only (with PP2 it is not the rank that replies): caught, recomputed.
    assert _corrupt_disk_files(next((tmp_path / "kv").iterdir()) / "rank0") > 0
    bad = _run(tiny_llama, **disk, **kw)
    assert bad[0] == off[0]
    assert bad[2].get("conveyor_kv_transfer_failures_total", 0) > 0
