"""Adapter-aware routing (conveyor/engine/dp/router/policy.py): a hot
adapter spreads once its engine crosses the spill bound, cold adapters stick
to their holders, the KV score still decides among holders, and the router's
hashes carry the adapter like the engine's. Pure Python, no engine."""
from __future__ import annotations

from types import SimpleNamespace

from conveyor.engine.dp.router.events import KVEvents
from conveyor.engine.dp.router.policy import Router, RouterSettings, block_hashes_of
from conveyor.engine.kv_cache.hashing import BlockHasher
from conveyor.engine.lora import LoRARequest

BS = 16


def _router(n: int) -> Router:
    return Router(RouterSettings(block_size=BS, seed=0), n)


def _toks(tag: int, n: int) -> list[int]:
    return [(tag * 7919 + i * 31) % 5000 + 1 for i in range(n)]


def _route(r: Router, rid: str, tokens: list[int], adapter: str | None, aid: int | None = None):
    return r.route(rid, block_hashes_of(tokens, BS, None, aid), len(tokens), 16, None, adapter)


def test_router_hashes_carry_the_adapter_like_the_engine() -> None:
    toks = _toks(1, 64)
    lr = LoRARequest("a", 7, "/x")
    req = SimpleNamespace(all_token_ids=toks, block_hashes=[], cache_salt="s", lora_request=lr)
    BlockHasher(BS).extend(req)
    assert req.block_hashes == block_hashes_of(toks, BS, "s", 7)
    assert block_hashes_of(toks, BS, "s", 7) != block_hashes_of(toks, BS, "s", 8)
    assert block_hashes_of(toks, BS, "s", None) != block_hashes_of(toks, BS, "s", 7)


def test_hot_adapter_spills_to_a_second_engine_and_is_not_pinned() -> None:
    r = _router(4)
    first = _route(r, "h0", _toks(0, 64), "hot").engine
    picks = [_route(r, f"h{i}", _toks(i, 64), "hot") for i in range(1, 12)]
    # It stays on its engine until that engine crosses the spill bound ...
    assert picks[0].engine == first
    spilled = [d for d in picks if d.engine != first]
    assert spilled and spilled[0].reason == "load_spill"
    # ... then spreads: more engines hold it, none of them holds everything.
    holders = r.engines_holding("hot")
    assert len(holders) >= 3 and first in holders
    assert max(r.inflight) <= 4
    # When the load goes away it is served by its holders again, not re-pinned.
    for i in range(12):
        r.finish(f"h{i}")
    assert _route(r, "again", _toks(99, 64), "hot").engine in holders


def test_cold_adapters_stick_to_the_engine_that_holds_them() -> None:
    r = _router(3)
    r.adapter_loaded(2, "cold")
    # Engine 2 is busier than the others, but under the spill bound.
    r.inflight[:] = [1, 1, 3]
    r.load_tokens[:] = [600.0, 600.0, 1200.0]
    for i in range(3):
        d = _route(r, f"c{i}", _toks(i, 64), "cold")
        assert d.engine == 2
        r.finish(f"c{i}")
    assert r.engines_holding("cold") == [2]
    # A base-model request ignores adapters and takes the least loaded engine.
    assert _route(r, "base", _toks(7, 64), None).engine in (0, 1)


def test_kv_score_still_decides_among_an_adapters_holders() -> None:
    r = _router(3)
    for e in (0, 1):
        r.adapter_loaded(e, "a")
    prefix = _toks(5, 128)
    # Engine 1 cached this prefix for adapter 3; engine 2 cached it for the base model.
    r.on_events(1, KVEvents(1, 1, block_hashes_of(prefix, BS, None, 3)))
    r.on_events(2, KVEvents(1, 1, block_hashes_of(prefix, BS, None, None)))
    d = _route(r, "k", prefix + _toks(6, 20), "a", 3)
    assert (d.engine, d.reason, d.predicted_cached_tokens) == (1, "cache_hit", 128)
    # The base-model request finds its own blocks on engine 2, not adapter 3's.
    d = _route(r, "kb", prefix + _toks(6, 20), None)
    assert (d.engine, d.reason) == (2, "cache_hit")


def test_adapter_holdings_are_bounded_and_forgotten_with_the_engine() -> None:
    r = Router(RouterSettings(block_size=BS, seed=0, max_adapters_per_engine=2), 2)
    for name in ("x", "y", "z"):
        r.adapter_loaded(0, name)
    assert r.engines_holding("x") == [] and r.engines_holding("z") == [0]
    r.adapter_unloaded("z")
    assert r.engines_holding("z") == []
    r.engine_down(0)
    assert r.engines_holding("y") == []


def test_data_parallel_client_routes_on_the_adapter_and_its_hashes() -> None:
    from fake_engines import FakeEngineClient, fake_fleet

    from conveyor.engine.config import build_config
    from conveyor.engine.contracts import EngineCoreRequest
    from conveyor.engine.sampling_params import SamplingParams

    engines = [FakeEngineClient(block_size=BS), FakeEngineClient(block_size=BS)]
    dp = fake_fleet(build_config(data_parallel_size=2), engines)
    lr = LoRARequest("ad", 5, "/x")
    toks = _toks(3, 64)
    dp.router.adapter_loaded(1, "ad")
    seen: list[tuple] = []
    route = dp.router.route
    dp.router.route = lambda *a, **kw: seen.append(a) or route(*a, **kw)  # type: ignore[method-assign]
    dp.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=toks, sampling_params=SamplingParams(
        max_tokens=4), arrival_time=0.0, priority=0, eos_token_id=None, lora_request=lr))
    assert engines[1].added_ids == ["r"]
    # The router scored the blocks engine 1 will hash for this request (adapter 5's).
    assert seen[0][1] == block_hashes_of(toks, BS, None, 5) and seen[0][5] == "ad"
