"""DataParallelEngine: N independent engine cores behind one frontend.

The EngineCore-shaped face the blocking LLM steps (as SyncCoreEngine is for
one core): `add_request` asks the router (engine/router/policy.py) which engine
takes the request, counts it there at once and hands it to that engine's
CoreClient; `step_fn` returns the next EngineCoreOutputs of any engine, after
feeding its prefix-cache events to the router's index (a gap asks that
engine for a snapshot) and releasing finished requests' load.

Each engine is an in-process core (its own busy-loop thread; executor
"uniproc" becomes "mp" per engine, since one process holds one
torch.distributed world) or, with executor "ray", an EngineCoreActor with its
own worker group and placement group. With data_parallel_size 1 nothing here
runs: LLM keeps its single core and its direct path.
"""
from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.contracts import EngineCoreOutputs, EngineCoreRequest
from engine.errors import EngineDeadError
from engine.frontend import resolved_max_tokens
from engine.router.policy import Router, RouterSettings, block_hashes_of

log = logging.getLogger(__name__)


def engine_config(config: EngineConfig) -> EngineConfig:
    """The config each replica runs: uniproc workers go to a process of their own."""
    if config.parallel.executor != "uniproc":
        return config
    return msgspec.structs.replace(config, parallel=msgspec.structs.replace(config.parallel, executor="mp"))


def make_engine_clients(config: EngineConfig) -> list[Any]:
    from engine.core_client import make_core_client

    cfg = engine_config(config)
    clients: list[Any] = []
    try:
        for _ in range(config.parallel.data_parallel_size):
            clients.append(make_core_client(cfg))
    except BaseException:
        for c in clients:
            c.shutdown()
        raise
    return clients


def router_settings(config: EngineConfig, block_size: int) -> RouterSettings:
    return RouterSettings(policy=config.serve.router, block_size=block_size, seed=config.model.seed)


class DataParallelEngine:
    def __init__(self, config: EngineConfig, clients: list[Any] | None = None) -> None:
        self.config = config
        self.clients = clients if clients is not None else make_engine_clients(config)
        self.kv_info = self.clients[0].kv_info
        self.router = Router(router_settings(config, self.kv_info.block_size), len(self.clients))
        self._hash = config.cache.enable_prefix_caching and config.serve.router in ("kv_aware", "session")
        self._outputs: queue.Queue[tuple[int, EngineCoreOutputs]] = queue.Queue()
        self._live: dict[str, int] = {}  # request id -> engine
        self._prefix = [[0, 0] for _ in self.clients]  # per engine: queried, hit tokens
        for i, c in enumerate(self.clients):
            c.start(self._sink(i))

    def _sink(self, i: int) -> Callable[[EngineCoreOutputs], None]:
        return lambda outs: self._outputs.put((i, outs))

    def add_request(self, request: EngineCoreRequest) -> None:
        toks = request.prompt_token_ids
        hashes = block_hashes_of(toks, self.kv_info.block_size, request.cache_salt) if self._hash else []
        max_tokens = resolved_max_tokens(request.sampling_params, len(toks), self.config.max_model_len)
        d = self.router.route(request.request_id, hashes, len(toks), max_tokens)
        self._live[request.request_id] = d.engine
        self.clients[d.engine].add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            e = self._live.pop(rid, None)
            if e is not None:
                by_engine.setdefault(e, []).append(rid)
                self.router.finish(rid)
        for e, ids in by_engine.items():
            self.clients[e].abort_requests(ids)

    def has_work(self) -> bool:
        return bool(self._live)

    def worker_pids(self) -> list[int]:
        return [pid for c in self.clients for pid in c.worker_pids()]

    def step_fn(self) -> tuple[EngineCoreOutputs, bool]:
        i, outs = self._outputs.get()
        if outs.kv_events is not None and not self.router.on_events(i, outs.kv_events):
            log.warning("engine %d: a gap in its prefix-cache events; asking for a snapshot", i)
            self.clients[i].request_kv_snapshot()
        if outs.scheduler_stats is not None:
            pcs, acc = outs.scheduler_stats.prefix_cache_stats, self._prefix[i]
            acc[0] += pcs.queries
            acc[1] += pcs.hits
        if outs.engine_error is not None:
            self._live.clear()
            raise EngineDeadError(f"engine {i}: {outs.engine_error}")
        for o in outs.outputs:
            if o.finished and self._live.pop(o.request_id, None) is not None:
                self.router.finish(o.request_id)
        return outs, True

    def metrics(self) -> dict[str, float]:
        """Per-engine series (an `engine` label): prefix-cache queries and hits
        in tokens, the router's decisions by policy and reason, index size."""
        out: dict[str, float] = {}
        for e, (q, h) in enumerate(self._prefix):
            out[f'conveyor:prefix_cache_queries_total{{engine="{e}"}}'] = q
            out[f'conveyor:prefix_cache_hits_total{{engine="{e}"}}'] = h
            out[f'conveyor:router_index_blocks{{engine="{e}"}}'] = self.router.index_size(e)
        for (policy, reason, e), n in sorted(self.router.decisions.items()):
            out[f'conveyor:router_decisions_total{{engine="{e}",policy="{policy}",reason="{reason}"}}'] = n
        return out

    def shutdown(self) -> None:
        for c in self.clients:
            c.shutdown()
