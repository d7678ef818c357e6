"""The data-parallel router (conveyor/engine/dp/router/): the four anchor failure modes,
the index under churn (restart, dropped event), policies. Pure Python, no engine."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from fake_engines import FakeEngineClient, fake_fleet

from conveyor.engine.core_client import metric_dict
from conveyor.engine.dp.router.events import KVEventPublisher, KVEvents
from conveyor.engine.dp.router.index import PrefixIndex
from conveyor.engine.dp.router.policy import Router, RouterSettings, block_hashes_of
from conveyor.engine.kv_cache.block_pool import BlockPool
from conveyor.engine.kv_cache.hashing import BlockHasher

BS = 16


def _router(n: int, **kw) -> Router:
    return Router(RouterSettings(block_size=BS, seed=0, **kw), n)


def _toks(tag: int, n: int) -> list[int]:
    return [(tag * 7919 + i * 31) % 5000 + 1 for i in range(n)]


def _cache_on(r: Router, e: int, tokens: list[int], epoch: int = 1) -> None:
    """Engine e reports every full block of `tokens` stored (one event)."""
    st = r.index.engines[e]
    if st.epoch != epoch:
        st.epoch, st.seq = epoch, 0

    assert r.on_events(e, KVEvents(epoch, st.seq + 1, block_hashes_of(tokens, BS)))


def _route(r: Router, rid: str, tokens: list[int], max_tokens: int = 16, session: str | None = None):
    return r.route(rid, block_hashes_of(tokens, BS), len(tokens), max_tokens, session)


def test_tied_burst_spreads_over_engines() -> None:
    """llm-d-router #2515: in-flight counts are updated at decision time, so a
    burst of equal-score requests does not all pick the same engine."""
    r = _router(4)
    picks = [_route(r, f"r{i}", _toks(i, 64)).engine for i in range(8)]
    assert sorted(picks.count(e) for e in range(4)) == [2, 2, 2, 2]


def test_one_hot_engine_spills_without_turning_cache_routing_off() -> None:
    """vllm-router #238: the balance check is per request, against the preferred engine."""
    r = _router(4)
    hot, warm = _toks(1, 1024), _toks(2, 1024)
    _cache_on(r, 0, hot)
    _cache_on(r, 1, warm)
    for i in range(12):  # engine 0 is swamped (by other routers' requests too, say)
        r.route(f"bg{i}", [], 8, 0)
        r._requests.pop(f"bg{i}")
    r.inflight[:] = [12, 0, 0, 0]
    # 12 requests, ~170 tokens of work each: lam x 2000 < the hot prefix's 1024
    # cached tokens, so the cost alone would keep it there; the load check moves it.
    r.load_tokens[:] = [2000.0, 0, 0, 0]
    d_warm = _route(r, "w", warm + _toks(3, 20))
    assert (d_warm.engine, d_warm.reason) == (1, "cache_hit")
    assert d_warm.predicted_cached_tokens == 1024
    d_hot = _route(r, "h", hot + _toks(4, 20))
    assert d_hot.engine != 0 and d_hot.reason == "load_spill"


def test_shared_system_prompt_does_not_pull_everything_to_one_engine() -> None:
    """production-stack #957: a system prompt every request shares (cached on
    one engine at first) must not send every request there. Each routed
    prompt is cached where it went (as the engine's events would say) and a
    request finishes 40 decisions later."""
    r = _router(4)
    system = _toks(9, 512)
    _cache_on(r, 0, system)
    picks, reasons = [], []
    for i in range(400):
        toks = system + _toks(100 + i, 128)
        d = _route(r, f"r{i}", toks, 64)
        picks.append(d.engine)
        reasons.append(d.reason)
        _cache_on(r, d.engine, toks)
        if i >= 40:
            r.finish(f"r{i - 40}")
    counts = [picks.count(e) for e in range(4)]
    assert max(counts) / (sum(counts) / 4) <= 1.1, counts
    assert max(r.inflight) <= 1.25 * r.inflight.mean() + 2
    assert reasons[200:].count("cache_hit") == 200  # prefix routing stays on


def test_chat_routes_on_the_whole_prompt_not_its_first_message() -> None:
    """sglang #26263: two conversations share the system prompt (their first
    message); each follow-up goes where its own history is cached."""
    r = _router(3)
    system = _toks(5, 128)
    conv_a, conv_b = system + _toks(11, 300), system + _toks(12, 300)
    _cache_on(r, 0, system)
    _cache_on(r, 1, conv_a)
    _cache_on(r, 2, conv_b)
    da = _route(r, "a2", conv_a + _toks(13, 40))
    db = _route(r, "b2", conv_b + _toks(14, 40))
    assert (da.engine, da.reason) == (1, "cache_hit")
    assert (db.engine, db.reason) == (2, "cache_hit")
    assert da.predicted_cached_tokens == (len(conv_a) // BS) * BS


def _req(tokens: list[int], salt: str | None = None) -> SimpleNamespace:
    """What BlockHasher and BlockPool read of a Request, hashed as the engine does."""
    req = SimpleNamespace(all_token_ids=list(tokens), block_hashes=[], cache_salt=salt, lora_request=None)
    BlockHasher(BS).extend(req)
    return req


def _engine_pool(pub: KVEventPublisher, num_blocks: int = 64) -> BlockPool:
    pool = BlockPool(num_blocks, enable_caching=True)
    pool.events = pub
    return pool


def _fill(pool: BlockPool, rid: str, tokens: list[int]) -> None:
    """What the KV manager does for a prefill: new blocks, hashed, then freed."""
    req = _req(tokens)
    n = len(req.block_hashes)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(req, blocks, 0, n)
    pool.free_blocks(reversed(blocks))


def test_index_follows_the_engines_own_pool_and_drops_it_on_restart() -> None:
    r = _router(2)
    pub = KVEventPublisher(seed=1)
    pool = _engine_pool(pub, num_blocks=9)  # 8 usable blocks
    a = _toks(1, 4 * BS)
    _fill(pool, "a", a)
    assert r.on_events(0, pub.drain(None))
    assert r.index.match(block_hashes_of(a, BS), 0b11) == {0: 4}
    b = _toks(2, 6 * BS)  # 6 more blocks: 2 of a's are evicted (LRU: a's tail first)
    _fill(pool, "b", b)
    assert r.on_events(0, pub.drain(None))
    assert r.index.size(0) == len(pool.cached_block_hash_to_block) == 8
    assert set(r.index.engines[0].held) == set(pool.cached_block_hash_to_block)
    # Restart: the engine's cache starts over with a new epoch; old entries go.
    pool2 = _engine_pool(pub)
    pub.cleared()
    assert r.on_events(0, pub.drain(None))
    assert r.index.size(0) == 0 and not r.index.owners
    _fill(pool2, "c", a)
    assert r.on_events(0, pub.drain(None))
    assert r.index.match(block_hashes_of(a, BS), 0b11) == {0: 4}
    r.engine_down(0)
    assert r.index.size(0) == 0 and _route(r, "x", a).engine == 1


def test_index_resyncs_from_a_snapshot_after_a_dropped_event() -> None:
    r = _router(2)
    pub = KVEventPublisher(seed=2)
    pool = _engine_pool(pub)
    _fill(pool, "a", _toks(1, 3 * BS))
    assert r.on_events(0, pub.drain(None))
    _fill(pool, "b", _toks(2, 3 * BS))
    pub.drain(None)  # lost on the way
    _fill(pool, "c", _toks(3, 2 * BS))
    assert r.on_events(0, pub.drain(None)) is False  # the gap is seen
    assert r.index.size(0) == 0  # nothing stale is used meanwhile
    _fill(pool, "d", _toks(4, 2 * BS))
    assert r.on_events(0, pub.drain(None))  # ignored until the snapshot
    assert r.index.size(0) == 0
    assert r.on_events(0, pub.snapshot(list(pool.cached_block_hash_to_block), None))
    assert set(r.index.engines[0].held) == set(pool.cached_block_hash_to_block)
    _fill(pool, "e", _toks(5, 2 * BS))
    assert r.on_events(0, pub.drain(None))
    assert set(r.index.engines[0].held) == set(pool.cached_block_hash_to_block)


def test_cache_salt_keeps_tenants_apart() -> None:
    toks = _toks(3, 64)
    assert block_hashes_of(toks, BS, "x") != block_hashes_of(toks, BS, None)
    req = _req(toks, "x")
    assert req.block_hashes == block_hashes_of(toks, BS, "x")


def test_index_cap_and_finish_release_load() -> None:
    idx = PrefixIndex(max_blocks_per_engine=4)

    hs = block_hashes_of(_toks(1, 10 * BS), BS)
    idx.apply(0, KVEvents(1, 1, hs))
    assert idx.size(0) == 4 and list(idx.engines[0].held) == hs[-4:]
    r = _router(2)
    d = _route(r, "a", _toks(1, 32), 8)
    assert r.load_tokens[d.engine] == 40 and r.inflight[d.engine] == 1
    r.finish("a")
    assert r.load_tokens.sum() == 0 and r.inflight.sum() == 0


@pytest.mark.parametrize("policy", ["session", "least_loaded", "power_of_two", "round_robin"])
def test_other_policies_balance_and_session_sticks(policy: str) -> None:
    r = _router(4, policy=policy)
    picks = [_route(r, f"r{i}", _toks(i, 32)).engine for i in range(8)]
    if policy != "power_of_two":
        assert sorted(picks.count(e) for e in range(4)) == [2, 2, 2, 2]
    if policy == "session":
        first = _route(r, "s1", _toks(50, 32), session="u1").engine
        assert _route(r, "s2", _toks(51, 32), session="u1") .engine == first


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_aware"):
        RouterSettings(policy="random")


def test_config_knobs_cli_flag_and_metrics_rows() -> None:
    import argparse

    from conveyor.cluster.cli.options import add_override_options, collect_overrides
    from conveyor.engine.config import ConfigError, build_config

    cfg = build_config(data_parallel_size=2, router="session")
    assert (cfg.parallel.data_parallel_size, cfg.serve.router) == (2, "session")
    assert build_config().serve.router == "kv_aware"
    with pytest.raises(ConfigError, match="serve.router"):
        build_config(router="random")
    with pytest.raises(ConfigError, match="parallel.data_parallel_size"):
        build_config(data_parallel_size=0)
    ap = argparse.ArgumentParser()
    add_override_options(ap)
    args = ap.parse_args(["--data-parallel-size", "4", "--router", "power_of_two"])
    assert collect_overrides(args) == {"parallel.data_parallel_size": 4, "serve.router": "power_of_two"}


def test_data_parallel_client_routes_sessions_feeds_events_and_resyncs() -> None:
    from conveyor.engine.config import build_config
    from conveyor.engine.contracts import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
    from conveyor.engine.sampling_params import SamplingParams

    engines = [FakeEngineClient(block_size=BS), FakeEngineClient(block_size=BS)]
    dp = fake_fleet(build_config(data_parallel_size=2, router="session"), engines)
    got: list[EngineCoreOutputs] = []
    dp.start(got.append)

    def req(rid: str, n: int = 40, session: str | None = None) -> EngineCoreRequest:
        return EngineCoreRequest(request_id=rid, prompt_token_ids=_toks(len(rid), n),
                                 sampling_params=SamplingParams(max_tokens=4), arrival_time=0.0,
                                 priority=0, eos_token_id=None, session=session)

    dp.add_request(req("a1", session="alice"))
    dp.add_request(req("b1", session="bob"))
    first = 0 if "a1" in engines[0].added_ids else 1
    dp.add_request(req("a2", session="alice"))
    assert "a2" in engines[first].added_ids and "b1" in engines[1 - first].added_ids
    # Events: in order they index, a gap asks that engine for a snapshot.
    hs = block_hashes_of(_toks(2, 64), BS)
    engines[0].emit(EngineCoreOutputs(kv_events=KVEvents(5, 1, hs[:2])))
    assert dp.router.index_size(0) == 2
    engines[0].emit(EngineCoreOutputs(kv_events=KVEvents(5, 3, hs[2:])))
    assert engines[0].snapshots == 1 and dp.router.index_size(0) == 0
    # A finished request releases its load; the frontend gets every message.
    owner = engines[first]
    owner.emit(EngineCoreOutputs(outputs=[EngineCoreOutput("a1", [7], FinishReason.LENGTH)]))
    assert dp.router.inflight.sum() == 2 and len(got) == 3
    m = metric_dict(dp.metric_rows())
    assert m[f'conveyor:router_decisions_total{{engine="{first}",policy="session",reason="session"}}'] == 1
