"""The router counts what an engine holds in its KV tiers (issue 47): the tier
connector reports its keys through the engine's event stream, the router
scores a tier block at tier_weight of a pool block. Pure Python, no engine."""
from __future__ import annotations

import pytest

from conveyor.engine.dp.router.events import KVEventPublisher, KVEvents
from conveyor.engine.dp.router.policy import Router, RouterSettings, block_hashes_of
from conveyor.engine.kv_connector.spec import TierSpec
from conveyor.engine.kv_connector.tiers import TierConnectorScheduler

BS = 16


def _router(n: int, **kw) -> Router:
    return Router(RouterSettings(block_size=BS, seed=0, **kw), n)


def _toks(tag: int, n: int) -> list[int]:
    return [(tag * 7919 + i * 31) % 5000 + 1 for i in range(n)]


def _feed(r: Router, e: int, pool: list[bytes], tier: list[bytes]) -> None:
    st = r.index.engines[e]
    assert r.on_events(e, KVEvents(1, st.seq + 1, pool, tier_stored=tier))


def test_tier_prefix_beats_nothing_and_pool_beats_tier() -> None:
    prompt = _toks(1, 257)
    h = block_hashes_of(prompt, BS)  # 16 full blocks
    r = _router(3)
    _feed(r, 1, [], h)  # engine 1: the whole prefix on its disk
    d = r.route("a", h, len(prompt), 8)
    assert (d.engine, d.reason, d.predicted_cached_tokens) == (1, "cache_hit", 256)
    r.finish("a")
    _feed(r, 2, h, [])  # engine 2: the same prefix in its pool
    d = r.route("b", h, len(prompt), 8)
    assert (d.engine, d.predicted_cached_tokens) == (2, 256)


def test_tier_blocks_continue_a_pool_match_and_weigh_tier_weight() -> None:
    prompt = _toks(2, 16 * BS + 1)
    h = block_hashes_of(prompt, BS)
    r = _router(2)
    _feed(r, 0, h[:4], h[4:12])  # pool 4 blocks, then 8 more from its tiers
    _feed(r, 1, h[:9], [])       # pool 9 blocks
    cached, score = r._matches(h, len(prompt), r._all_mask)
    assert cached == {0: 12 * BS, 1: 9 * BS}
    assert score == {0: 4 * BS + 0.75 * 8 * BS, 1: 9 * BS}  # 160 vs 144: engine 0
    assert r.route("a", h, len(prompt), 8).engine == 0
    # A tier key behind a gap is no continuation: the engine loads only from its pool's end.
    r2 = _router(1)
    _feed(r2, 0, h[:2], h[3:8])
    assert r2._matches(h, len(prompt), 1)[0] == {0: 2 * BS}


def test_tier_events_follow_the_connector_and_survive_an_epoch() -> None:
    spec = TierSpec(block_size=BS, bytes_per_block=64, cpu_blocks=2, disk_blocks=0,
                    disk_folder=None, model_id="", load_timeout_s=5.0)
    conn = TierConnectorScheduler(spec)
    pub = KVEventPublisher(seed=0)
    conn.attach_events(pub)
    r = _router(1)
    keys = [bytes([i]) * 32 for i in range(3)]
    conn.on_block_evicted(5, keys[0])
    conn.on_block_evicted(6, keys[1])
    assert r.on_events(0, pub.drain(None))
    assert r._matches([keys[0], keys[1]], 3 * BS, 1)[0] == {0: 2 * BS}
    conn.on_block_evicted(7, keys[2])  # the host tier is full: keys[0], its LRU, goes
    ev = pub.drain(None)
    assert (ev.tier_stored, ev.tier_removed) == ([keys[2]], [keys[0]])
    assert r.on_events(0, ev)
    assert r._matches([keys[1], keys[2]], 3 * BS, 1)[0] == {0: 2 * BS}
    assert r._matches([keys[0]], 2 * BS, 1)[0] == {}
    # The pool's cache starts over (a new epoch): the router forgets the engine,
    # and the first message of the new epoch re-announces what the tiers hold.
    pub.cleared()
    ev = pub.drain(None)
    assert sorted(ev.tier_stored) == sorted(keys[1:])
    assert r.on_events(0, ev)
    assert r._matches([keys[1], keys[2]], 3 * BS, 1)[0] == {0: 2 * BS}
    snap = pub.snapshot([], None)
    assert sorted(snap.tier_stored) == sorted(keys[1:])
    assert r.on_events(0, snap)
    conn.reset(lost_workers=True)  # the host tier dies with the workers
    ev = pub.drain(None)
    assert sorted(ev.tier_removed) == sorted(keys[1:])
    assert r.on_events(0, ev)
    assert not r.tiers.owners


def test_a_key_moving_between_tiers_stays_announced(tmp_path) -> None:
    spec = TierSpec(block_size=BS, bytes_per_block=64, cpu_blocks=1, disk_blocks=4,
                    disk_folder=tmp_path, model_id="m", load_timeout_s=5.0)
    conn = TierConnectorScheduler(spec)
    pub = KVEventPublisher(seed=0)
    conn.attach_events(pub)
    a, b = b"a" * 32, b"b" * 32
    conn.on_block_evicted(1, a)
    conn.on_block_evicted(2, b)  # a is demoted host -> disk: still in the tiers
    ev = pub.drain(None)
    assert (ev.tier_stored, ev.tier_removed) == ([a, b], [])


def test_tier_weight_is_bounded() -> None:
    with pytest.raises(ValueError, match="tier_weight"):
        RouterSettings(tier_weight=1.5)


def test_router_hashes_images_as_the_engine_does() -> None:
    """The same text behind two images: the router's hashes are the engine's
    (BlockHasher), differ from the block the image's placeholders meet on, and
    agree before it; so a prefix hit is never predicted across images."""
    from types import SimpleNamespace

    from conveyor.engine.kv_cache.hashing import BlockHasher
    from conveyor.engine.multimodal.features import MultiModalFeature

    tokens = _toks(3, 6 * BS)
    img = [MultiModalFeature(h, 2 * BS + 5, 20, b"", [1]) for h in ("aa", "bb")]
    routed = [block_hashes_of(tokens, BS, mm_features=[f]) for f in img]
    for f, mine in zip(img, routed):
        req = SimpleNamespace(all_token_ids=list(tokens), block_hashes=[], cache_salt=None,
                              lora_request=None, mm_features=[f])
        BlockHasher(BS).extend(req)
        assert req.block_hashes == mine
    assert routed[0][:2] == routed[1][:2] and routed[0][2] != routed[1][2]
    assert routed[0][:2] == block_hashes_of(tokens, BS)[:2]
