"""DataParallelClient: N independent engine cores behind one frontend.

A CoreClient (engine/core_client.py), so the blocking LLM (through
SyncCoreEngine) and AsyncLLM (offline, Serve, batch) drive N engines exactly
as they drive one. `add_request` asks the router (engine/router/policy.py)
which engine takes the request, counts it there at once and hands it to that
engine's client; every engine's outputs go to the frontend's one handler,
after their prefix-cache events have fed the router's index (a gap asks that
engine for a snapshot) and finished requests have released their load. The
router is called from the frontend's thread and from the engines' output
threads, so it sits behind one lock.

Each engine is an in-process core (its own busy-loop thread; executor
"uniproc" becomes "mp" per engine, since one process holds one
torch.distributed world), or an EngineCoreActor (executor "ray", or any
executor in a Serve replica: `make_engine_client` decides). With
data_parallel_size 1 nothing here runs (no extra hop).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.contracts import EngineCoreOutputs, EngineCoreRequest
from engine.frontend import resolved_max_tokens
from engine.router.policy import Router, RouterSettings, block_hashes_of

log = logging.getLogger(__name__)

OutputHandler = Callable[[EngineCoreOutputs], None]


def engine_config(config: EngineConfig) -> EngineConfig:
    """The config each in-process replica runs: uniproc workers go to a process of their own."""
    if config.parallel.executor != "uniproc":
        return config
    return msgspec.structs.replace(config, parallel=msgspec.structs.replace(config.parallel, executor="mp"))


def make_engine_clients(config: EngineConfig,
                        make_one: Callable[[EngineConfig], Any] | None = None) -> list[Any]:
    if make_one is None:
        from engine.core_client import make_single_core_client

        make_one, config = make_single_core_client, engine_config(config)
    clients: list[Any] = []
    try:
        for _ in range(config.parallel.data_parallel_size):
            clients.append(make_one(config))
    except BaseException:
        for c in clients:
            c.shutdown()
        raise
    return clients


class DataParallelClient:
    takes_session = True  # add_request(request, session=...) (AsyncLLM checks)

    def __init__(self, config: EngineConfig, clients: list[Any] | None = None) -> None:
        self.config = config
        self.clients = clients if clients is not None else make_engine_clients(config)
        self.kv_info = self.clients[0].kv_info
        self.router = Router(RouterSettings(policy=config.serve.router, block_size=self.kv_info.block_size,
                                            seed=config.model.seed), len(self.clients))
        self._hash = config.cache.enable_prefix_caching and config.serve.router in ("kv_aware", "session")
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}  # request id -> engine
        self._prefix = [[0, 0] for _ in self.clients]  # per engine: queried, hit tokens

    def start(self, on_outputs: OutputHandler) -> None:
        for i, c in enumerate(self.clients):
            c.start(self._sink(i, on_outputs))

    def _sink(self, i: int, on_outputs: OutputHandler) -> OutputHandler:
        def handle(outs: EngineCoreOutputs) -> None:
            snapshot = False
            with self._lock:
                if outs.kv_events is not None and not self.router.on_events(i, outs.kv_events):
                    snapshot = True
                if outs.scheduler_stats is not None:
                    pcs, acc = outs.scheduler_stats.prefix_cache_stats, self._prefix[i]
                    acc[0] += pcs.queries
                    acc[1] += pcs.hits
                for o in outs.outputs:
                    if o.finished and self._live.pop(o.request_id, None) is not None:
                        self.router.finish(o.request_id)
                        log.debug("request %s on engine %d: actual cached tokens %d",
                                  o.request_id, i, o.num_cached_tokens)
            if snapshot:
                log.warning("engine %d: a gap in its prefix-cache events; asking for a snapshot", i)
                self.clients[i].request_kv_snapshot()
            if outs.engine_error is not None:
                outs.engine_error = f"engine {i}: {outs.engine_error}"
            on_outputs(outs)
        return handle

    def add_request(self, request: EngineCoreRequest, session: str | None = None) -> None:
        toks, lr = request.prompt_token_ids, request.lora_request
        hashes = block_hashes_of(toks, self.kv_info.block_size, request.cache_salt,
                                 lr and lr.lora_int_id) if self._hash else []
        max_tokens = resolved_max_tokens(request.sampling_params, len(toks), self.config.max_model_len)
        with self._lock:
            d = self.router.route(request.request_id, hashes, len(toks), max_tokens, session,
                                  lr and lr.lora_name)
            self._live[request.request_id] = d.engine
        self.clients[d.engine].add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                e = self._live.pop(rid, None)
                if e is not None:
                    by_engine.setdefault(e, []).append(rid)
                    self.router.finish(rid)
        for e, ids in by_engine.items():
            self.clients[e].abort_requests(ids)

    def check_health(self) -> str:
        """"ok" when every engine is; "recovering" when one is; raises when one is dead."""
        states = [c.check_health() for c in self.clients]
        return "recovering" if "recovering" in states else "ok"

    def worker_pids(self) -> list[int]:
        return [pid for c in self.clients for pid in c.worker_pids()]

    def metric_rows(self) -> list[tuple[str, str, dict[str, str], float]]:
        """Per-engine series, each with an `engine` label: (name, kind, labels,
        value) for prefix-cache queries and hits in tokens, the router's
        decisions by policy and reason, and its index size in blocks."""
        rows: list[tuple[str, str, dict[str, str], float]] = []
        with self._lock:
            for e, (q, h) in enumerate(self._prefix):
                lab = {"engine": str(e)}
                rows += [("prefix_cache_queries", "counter", lab, q), ("prefix_cache_hits", "counter", lab, h),
                         ("router_index_blocks", "gauge", lab, self.router.index_size(e))]
            for (policy, reason, e), n in sorted(self.router.decisions.items()):
                rows.append(("router_decisions", "counter",
                             {"engine": str(e), "policy": policy, "reason": reason}, n))
        return rows

    def metrics(self) -> dict[str, float]:
        """metric_rows keyed by their Prometheus names (LLM.get_metrics)."""
        out: dict[str, float] = {}
        for name, kind, lab, v in self.metric_rows():
            labels = ",".join(f'{k}="{x}"' for k, x in lab.items())
            out[f"conveyor:{name}{'_total' if kind == 'counter' else ''}{{{labels}}}"] = v
        return out

    def shutdown(self) -> None:
        # Last first: the first client may own the Ray instance it started.
        for c in reversed(self.clients):
            c.shutdown()
