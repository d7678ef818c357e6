"""The KV tiers' parts without a model: the tier index (LRU, pins, never
raising), the disk file format (every kind of bad file is a miss), the
worker side on plain tensors (round trip, checksums, an error fails only its
blocks), the two connector registries, and the config rules."""
from __future__ import annotations

import os
import time

import msgspec
import pytest
import torch

from conveyor.engine.config import ConfigError, EngineConfig, load_config
from conveyor.engine.contracts import KVCacheInfo
from conveyor.engine.kv_connector import disk_format
from conveyor.engine.kv_connector.metadata import TIER_CPU, TIER_DISK, BlockSave, KVConnectorMetadata, TierLoad
from conveyor.engine.kv_connector.registry import CONNECTORS, connector_name
from conveyor.engine.kv_connector.spec import TierSpec
from conveyor.engine.kv_connector.tier_index import TierIndex
from conveyor.workers.kv_connector import WORKER_CONNECTORS
from conveyor.workers.kv_connector.tiers import TierConnectorWorker


def test_tier_index_evicts_lru_and_never_pinned_keys():
    idx = TierIndex(2)
    a = idx.insert(b"a", ready=True)
    b = idx.insert(b"b", ready=True)
    assert a is not None and b is not None and {a[0], b[0]} == {0, 1}
    idx.touch(b"a")  # b is now least recently used
    c = idx.insert(b"c", ready=True)
    assert c is not None and c[1] == b"b" and c[0] == b[0]  # b's slot, reused
    idx.pinned.add(b"a")
    idx.held[b"c"] += 1
    assert idx.insert(b"d", ready=True) is None  # everything pinned: declined, no raise
    idx.pinned.clear()
    d = idx.insert(b"d", ready=False)
    assert d is not None and d[1] == b"a" and idx.loadable(b"d") is None
    assert len(idx) == 2 and TierIndex(0).insert(b"x", True) is None


def test_disk_format_rejects_every_bad_file(tmp_path):
    key, payload = b"k" * 32, bytes(range(200))
    disk_format.write_atomic(tmp_path, key, disk_format.encode(key, "m1", payload))
    data = disk_format.read(tmp_path, key)
    assert data is not None and disk_format.decode(data, key, "m1", 200) == payload
    flipped = bytearray(data)
    flipped[-1] ^= 1
    for bad, why in [(bytes(flipped), "a flipped payload byte"), (data[:-1], "truncated"),
                     (b"junk" + data[4:], "bad magic"), (b"", "empty"), (data[:10], "torn header")]:
        assert disk_format.decode(bad, key, "m1", 200) is None, why
    assert disk_format.decode(data, b"x" * 32, "m1", 200) is None  # another block's file
    assert disk_format.decode(data, key, "m2", 200) is None  # another model's
    assert disk_format.decode(data, key, "m1", 100) is None  # another layout's
    assert disk_format.read(tmp_path, b"z" * 32) is None  # missing


def test_disk_scan_lists_oldest_first_and_drops_temp_files(tmp_path):
    for i, key in enumerate([b"b" * 32, b"a" * 32]):
        disk_format.write_atomic(tmp_path, key, disk_format.encode(key, "m", b"x"))
        os.utime(disk_format.block_path(tmp_path, key), (1000 + i, 1000 + i))
    (tmp_path / ("c" * 64 + ".kvb.tmp123.4")).write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("not a block")
    assert disk_format.scan(tmp_path) == [b"b" * 32, b"a" * 32]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [("b" * 32).encode().hex() + ".kvb", ("a" * 32).encode().hex() + ".kvb", "notes.txt"])


def _caches(num_blocks: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(num_blocks, 2, 4, 2, 8, generator=g),
            torch.randn(num_blocks, 2, 4, 1, 8, generator=g).to(torch.bfloat16)]


def _worker(caches: list[torch.Tensor], tmp_path=None, cpu_blocks: int = 2, timeout: float = 5.0) -> TierConnectorWorker:
    bpb = sum(c[0].numel() * c.element_size() for c in caches)
    spec = TierSpec(block_size=4, bytes_per_block=bpb, cpu_blocks=cpu_blocks, disk_blocks=8 if tmp_path else 0,
                    disk_folder=tmp_path, model_id="m", load_timeout_s=timeout)
    return TierConnectorWorker(spec, caches)


def _load(load_id: int, keys: list[bytes], tiers: list[int], slots: list[int], blocks: list[int]) -> KVConnectorMetadata:
    return KVConnectorMetadata(loads=[TierLoad(load_id, "r", keys, tiers, slots, blocks)])


def test_host_tier_round_trip_and_checksum(tmp_path):
    caches = _caches()
    w = _worker(caches)
    before = [c[1].clone() for c in caches]
    w.start_load_kv(KVConnectorMetadata(cpu_saves=[BlockSave(b"k1", 1, 0)]))
    w.start_load_kv(_load(7, [b"k1"], [TIER_CPU], [0], [4]))
    out = w.get_output()
    assert out is not None and out.finished_loads == [7] and out.invalid_block_ids == []
    assert all(torch.equal(c[4], b) for c, b in zip(caches, before))
    assert w.host is not None
    w.host[0, 3] ^= 0xFF  # one corrupted byte in the stored block
    caches[0][5].zero_()
    w.start_load_kv(_load(8, [b"k1"], [TIER_CPU], [0], [5]))
    out = w.get_output()
    assert out is not None and out.invalid_block_ids == [5] and out.transfer_failures == 1
    assert caches[0][5].abs().sum() == 0  # a block that fails its check is never copied
    w.start_load_kv(_load(9, [b"other"], [TIER_CPU], [0], [5]))  # the slot holds another key
    out = w.get_output()
    assert out is not None and out.invalid_block_ids == [5]


def test_disk_tier_round_trip_late_and_error(tmp_path, monkeypatch):
    caches = _caches()
    w = _worker(caches, tmp_path, cpu_blocks=0, timeout=0.2)
    w.start_load_kv(KVConnectorMetadata(disk_saves=[BlockSave(b"d1", 2, -1)]))
    assert w.disk is not None
    deadline = time.monotonic() + 5
    saved: list[bytes] = []
    while not saved and time.monotonic() < deadline:
        out = w.get_output()
        saved += out.disk_saved if out is not None else []
    assert saved == [b"d1"]
    want = [c[2].clone() for c in caches]
    w.start_load_kv(_load(1, [b"d1", b"missing"], [TIER_DISK, TIER_DISK], [-1, -1], [3, 4]))
    out = None
    while out is None or not out.finished_loads:
        time.sleep(0.01)
        w.start_load_kv(None)  # later steps finish the reads
        out = w.get_output()
    assert out.finished_loads == [1] and out.invalid_block_ids == [4]
    assert all(torch.equal(c[3], x) for c, x in zip(caches, want))
    # A read that never arrives: reported invalid at the deadline, never copied after.
    monkeypatch.setattr(w.disk, "_read", lambda key: time.sleep(1.0))
    w.start_load_kv(_load(2, [b"d1"], [TIER_DISK], [-1], [5]))
    time.sleep(0.3)
    w.start_load_kv(None)
    out = w.get_output()
    assert out is not None and out.finished_loads == [2] and out.invalid_block_ids == [5]
    # A transfer error fails its own blocks only; the next save works.
    monkeypatch.setattr(w.codec, "gather", lambda *a: (_ for _ in ()).throw(OSError("bus error")))
    w.start_load_kv(KVConnectorMetadata(disk_saves=[BlockSave(b"e", 1, -1)]))
    out = w.get_output()
    assert out is not None and out.failed_saves == [b"e"] and out.transfer_failures == 1
    w.close()


def test_registries_name_the_same_connectors():
    assert set(CONNECTORS) == set(WORKER_CONNECTORS) == {"tiers"}
    cfg = msgspec.convert({"cache": {"offload_cpu_gb": 1.0}}, EngineConfig)
    assert connector_name(cfg) == "tiers" and connector_name(EngineConfig()) is None
    kv = KVCacheInfo(10, 16, 4096, 100, "float32")
    assert CONNECTORS["tiers"](cfg, kv).spec.cpu_blocks == (1 << 30) // 4096


@pytest.mark.parametrize("over, key", [
    ({"cache": {"offload_disk_gb": 1.0}}, "cache.offload_disk_path"),
    ({"cache": {"offload_cpu_gb": 1.0, "enable_prefix_caching": False}}, "cache.enable_prefix_caching"),
    ({"cache": {"offload_cpu_gb": -1.0}}, "cache.offload_cpu_gb"),
    ({"cache": {"kv_load_timeout_s": 0.0}}, "cache.kv_load_timeout_s"),
])
def test_tier_config_rules(tmp_path, over, key):
    path = tmp_path / "c.yaml"
    path.write_text(msgspec.json.encode({"model": {"path": "/nowhere"}, **over}).decode())
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(str(path))


def test_rank_merge_agrees_only_when_every_rank_did():
    """TP/PP: a load is finished, a save durable, only once every rank
    reported it; a block bad on one rank is invalid for the engine."""
    from conveyor.engine.kv_connector.metadata import KVConnectorOutput as Out
    from conveyor.workers.kv_connector.rank_merge import RankMerge

    m = RankMerge(2)
    m.note(KVConnectorMetadata(loads=[TierLoad(7, "r", [b"a", b"b"], [TIER_DISK] * 2, [-1, -1], [3, 4])],
                               disk_saves=[BlockSave(b"k", 9), BlockSave(b"x", 8)]))
    step1 = m.merge([Out(finished_loads=[7], invalid_block_ids=[4], disk_saved=[b"k"], transfer_bytes=10),
                     Out(failed_saves=[b"x"], transfer_failures=1)])
    assert step1 is not None
    assert (step1.finished_loads, step1.disk_saved, step1.failed_saves) == ([], [], [b"x"])
    assert (step1.transfer_bytes, step1.transfer_failures) == (10, 1)
    step2 = m.merge([None, Out(finished_loads=[7], disk_saved=[b"k", b"x"])])
    assert step2 is not None
    assert (step2.finished_loads, step2.invalid_block_ids, step2.disk_saved) == ([7], [4], [b"k"])
    assert m.num_pending == 1  # x: saved by one rank after failing on the other, never durable
    m.note(KVConnectorMetadata(disk_saves=[BlockSave(b"x", 8)]))  # written again: counted afresh
    assert m.num_pending == 0
    assert m.merge([None, None]) is None


def test_a_lease_ends_when_released_or_at_its_deadline(tmp_path):
    """A prefill leg's blocks stay held on disk (not evictable) until the
    decode engine has them (an abort of the finished leg) or the lease's
    deadline, whichever comes first."""
    from sched_utils import make_request

    from conveyor.engine.kv_connector.tiers import TierConnectorScheduler

    spec = TierSpec(block_size=4, bytes_per_block=8, cpu_blocks=0, disk_blocks=8, disk_folder=tmp_path / "kv",
                    model_id="m", load_timeout_s=5.0)
    conn = TierConnectorScheduler(spec)
    now = [0.0]
    conn.clock = lambda: now[0]
    legs = []
    for rid in ("a", "b"):
        req = make_request(rid, list(range(1, 13)) if rid == "a" else list(range(20, 32)))
        req.block_hashes = [bytes([ord(rid), i]) * 16 for i in range(3)]
        req.kv_lease_s = 10.0
        conn.request_finished(req, [1, 2, 3])
        legs.append(req)
    assert all(conn.disk.held[k] == 1 for r in legs for k in r.block_hashes)
    conn.release_lease("a")  # decode has a's blocks
    assert not any(k in conn.disk.held for k in legs[0].block_hashes)
    assert all(conn.disk.held[k] == 1 for k in legs[1].block_hashes)
    now[0] = 10.5
    conn.build_connector_meta()  # b's deadline passed
    assert not conn.disk.held and not conn._leases


def test_a_failed_block_from_another_engine_is_never_asked_for_again(tmp_path):
    """The prefill engine died before writing a handed-over block: the decode
    engine's load finds it missing, and the request recomputes. Its KVTransfer
    still names the blocks, so re-admission (also after a preemption) must not
    ask for them again: each ask waits out wait_s, and it looped forever in CI."""
    from sched_utils import make_request

    from conveyor.engine.kv_connector.metadata import KVConnectorOutput, KVTransfer
    from conveyor.engine.kv_connector.tiers import TierConnectorScheduler

    spec = TierSpec(block_size=4, bytes_per_block=8, cpu_blocks=0, disk_blocks=8, disk_folder=tmp_path / "kv",
                    model_id="m", load_timeout_s=5.0)
    conn = TierConnectorScheduler(spec)
    req = make_request("r", list(range(1, 14)))  # 13 tokens: 3 full blocks, the last one computed
    req.block_hashes = [bytes([7, i]) * 16 for i in range(3)]
    req.kv_transfer = KVTransfer("prefill", 3, wait_s=0.5)
    assert conn.get_num_new_matched_tokens(req, 0) == (12, True)
    load_id = conn.update_state_after_alloc(req, [10, 11, 12], 12)
    [res] = conn.update_connector_output(KVConnectorOutput(finished_loads=[load_id], invalid_block_ids=[11]))
    assert res.num_valid_tokens == 4  # block 0 came; block 1 did not
    assert conn.get_num_new_matched_tokens(req, 4) == (0, False)
    conn.request_reset("r")  # preempted: still not asked again
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.request_finished(req, [])
    assert "r" not in conn._no_remote
