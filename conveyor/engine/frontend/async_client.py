"""AsyncLLM: the async frontend used by serving and batch jobs.

It validates and tokenizes, fans `n > 1` out into child requests, sends them
through a CoreClient, and routes each step's EngineCoreOutputs to per-request
output slots as deltas (new text, new token ids, new logprobs). Stop strings
are detected here and abort the request in the core. A stream that is closed
before it finished (client disconnect) aborts its requests exactly once.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from conveyor.engine.config import EngineConfig, check_model_dir
from conveyor.engine.contracts import EngineCoreOutputs, SchedulerStats
from conveyor.engine.core_client import NOT_DATA_PARALLEL, CoreClient, CoreClientFactory, FleetAdmin
from conveyor.engine.errors import EngineDeadError
from conveyor.engine.frontend.clients import make_core_client
from conveyor.engine.frontend.expert_counters import ExpertCounters
from conveyor.engine.frontend.kv_tier_counters import KVTierCounters
from conveyor.engine.frontend.output_processor import CompletionOutput, RequestOutput, RequestState, resumed_requests
from conveyor.engine.frontend.prepare import Frontend, PreparedRequest, Prompt
from conveyor.engine.lora import LoRARequest
from conveyor.engine.sampling_params import SamplingFields
from conveyor.engine.spec_decode.metrics import SpecDecodeCounters

__all__ = ["AsyncLLM", "EngineDeadError", "collect"]


@dataclass
class _Stream:
    """One user request's output slot. Deltas that arrive before the consumer
    takes them are merged (text and token ids concatenated per choice), so a
    consumer that falls behind the engine takes several steps at once instead
    of falling further behind (vLLM's RequestOutputCollector does the same)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[RequestState]
    pending: dict[int, CompletionOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0
    # Child 0's (only it computes them); every delta from then on carries them.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    final: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def put(self, deltas: list[CompletionOutput], num_cached_tokens: int) -> None:
        for d in deltas:  # each d is fresh (built by _delta), so it may be extended in place
            acc = self.pending.get(d.index)
            if acc is None:
                self.pending[d.index] = d
            else:
                acc.merge(d)
        self.num_cached_tokens = num_cached_tokens
        if self.prompt_logprobs is None and self.children:
            self.prompt_logprobs = self.children[0].prompt_logprobs
        self.ready.set()
        if self.finished:
            self.final.set()

    async def wait_until(self, deadline: float) -> None:
        """Sleep until `deadline` (time.monotonic) or the finish, whichever is first."""
        delay = deadline - time.monotonic()
        if delay > 0.0 and not self.finished:
            try:
                await asyncio.wait_for(self.final.wait(), delay)
            except TimeoutError:
                pass

    def take(self) -> RequestOutput:
        outs = [self.pending[k] for k in sorted(self.pending)]
        self.pending = {}
        self.ready.clear()
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             self.num_cached_tokens, self.finished, self.prompt_logprobs)


@dataclass
class CumulativeHistogram:
    """Prometheus-style histogram kept by the frontend (bucket upper bounds in seconds)."""
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; +1 for +Inf
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value


_GRAMMAR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BITMASK_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


@dataclass
class EngineCounters:
    """Cumulative numbers for /metrics (the frontend's own view)."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    structured_requests: int = 0
    grammar_compile: CumulativeHistogram = field(
        default_factory=lambda: CumulativeHistogram(_GRAMMAR_BUCKETS))
    # Per step that had structured rows: the bitmask's wall time.
    bitmask_step: CumulativeHistogram = field(
        default_factory=lambda: CumulativeHistogram(_BITMASK_BUCKETS))
    spec_decode: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)
    experts: ExpertCounters = field(default_factory=ExpertCounters)
    kv_tiers: KVTierCounters = field(default_factory=KVTierCounters)
    encoder_cache_hits: int = 0  # images whose encoder output was reused


class AsyncLLM:
    def __init__(self, config: EngineConfig, client: CoreClient | None = None, *,
                 core_client_factory: CoreClientFactory | None = None) -> None:
        """`client`: a ready core client (Serve builds its own); else one is
        made for the config, a core in an actor by `core_client_factory`
        (default: cluster's RayCoreClient)."""
        self.config = config
        if client is None:
            check_model_dir(config)
        self.client = client if client is not None else make_core_client(config, core_client_factory)
        self.max_model_len = config.max_model_len
        self.frontend = Frontend(config, self.client.kv_info.vocab_size)
        self.tokenizer = self.frontend.tokenizer
        self.streams: dict[str, _Stream] = {}
        # Request ids taken ahead of their stream (reserve_ids: the HTTP
        # server's, from admission); with the streams' own, the ids in use.
        self._reserved: set[str] = set()
        self._child_to_stream: dict[str, tuple[_Stream, RequestState]] = {}
        self.stats = SchedulerStats()
        self.counters = EngineCounters()
        self.dead = self.client.dead  # the client's: one record that the engine is dead
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()

    # ---- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Start the engine's output routing on the running event loop
        (idempotent; generate() calls it too)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self.client.start(self._on_outputs_threadsafe)

    def _on_outputs_threadsafe(self, outs: EngineCoreOutputs) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._process, outs)

    def check_health(self) -> str:
        """"ok", or "recovering" while a lost worker group is rebuilt; raises
        EngineDeadError when the engine is dead."""
        self.dead.check()
        return self.client.check_health()

    def worker_pids(self) -> list[int]:
        """Live worker process ids in rank order."""
        return self.client.worker_pids()

    async def drain(self, engine: int, timeout_s: float = 60.0) -> int:
        """Data parallel: move every request off `engine` to the others and
        route nothing more there; returns (how many moved) once it holds none.
        Streams go on without a break (DataParallelClient.drain)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.admin.drain, engine, timeout_s)

    def undrain(self, engine: int) -> None:
        """A drained engine takes requests again."""
        self.admin.undrain(engine)

    @property
    def admin(self) -> FleetAdmin:
        """The fleet's operations; ValueError (NOT_DATA_PARALLEL) for one engine."""
        admin = self.client.admin
        if admin is None:
            raise ValueError(NOT_DATA_PARALLEL)
        return admin

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)

    async def shutdown(self) -> None:
        for s in list(self.streams.values()):
            self._abort_stream(s, "abort")
        await asyncio.get_running_loop().run_in_executor(None, self.client.shutdown)

    # ---- requests ----------------------------------------------------------------

    @property
    def dead_error(self) -> str | None:
        """Why the engine died (None while it lives)."""
        return self.dead.cause

    def reserve_ids(self, request_ids: list[str]) -> None:
        """The one check that request ids are not in use (a request id in
        flight twice would let one request's clean-up abort the other): takes
        them all, or raises ValueError and takes none. generate() with a
        reserved id runs under that reservation; release_ids gives back what
        no stream took (a stream's id is free again once it ends)."""
        taken = [r for r in request_ids if r in self._reserved or r in self.streams]
        if taken or len(set(request_ids)) < len(request_ids):
            raise ValueError(f"request id {(taken or request_ids)[0]!r} is already in use")
        self._reserved.update(request_ids)

    def release_ids(self, request_ids: list[str]) -> None:
        self._reserved.difference_update(request_ids)

    def _take_id(self, rid: str) -> None:
        """A new stream takes its id: the caller's reservation, or checked free now."""
        if rid not in self._reserved:
            self.reserve_ids([rid])
        self._reserved.discard(rid)

    def prepare(self, prompt: Prompt, sp: SamplingFields,
                request_id: str | None = None, priority: int = 0,
                lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Tokenize and check the engine's limits; raises ValueError (nothing
        queued). Pass the result to generate(prepared=...) to run it without
        checking twice. Engine ids get a random suffix: a client that reuses a
        request id (a retry after an abort) never meets late outputs of the
        earlier request, whose abort may still be on its way to the core."""
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        self.dead.check()
        return self.frontend.prepare(prompt, sp, rid, priority, id_suffix=f"-{secrets.token_hex(4)}",
                                     lora_request=lora_request)

    async def generate(self, prompt: str | list[int], sampling_params: SamplingFields,
                       request_id: str | None = None, priority: int = 0,
                       min_interval_s: float = 0.0,
                       prepared: PreparedRequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yields deltas: each RequestOutput carries only the choices that
        changed, with their new text/token ids/logprobs; the last has finished=True.

        min_interval_s: after the first delta, yield at most once per interval;
        steps that finish in between are merged into the next delta. The finish
        is never held back. Caps a fast model's per-token overhead downstream
        (SSE events) without delaying a model whose steps are slower anyway.

        prepared: what prepare() returned for these arguments (they are then
        ignored). A failed add (a dead engine) aborts the children already
        added and drops the stream before the error propagates."""
        self.start()
        prep = prepared or self.prepare(prompt, sampling_params, request_id, priority)
        self.dead.check()  # prepared earlier: the engine may have died since
        rid, ids, reqs = prep.request_id, prep.prompt_token_ids, prep.children
        for r in reqs:
            r.session = prep.session
        self._take_id(rid)
        children = [RequestState.make(r.request_id, k, r.sampling_params, ids, self.tokenizer, r)
                    for k, r in enumerate(reqs)]
        stream = _Stream(rid, prep.prompt, ids, children)
        self.streams[rid] = stream
        for r, c in zip(reqs, children):
            self._child_to_stream[r.request_id] = (stream, c)
        self.counters.prompt_tokens += len(ids) * len(reqs)
        for i, r in enumerate(reqs):
            try:
                self.client.add_request(r)
            except BaseException:
                for c in children[i:]:
                    c.fail("error")  # never reached the engine: nothing to abort there
                self._abort_stream(stream, "error")  # aborts the siblings already added
                raise
        try:
            next_at = 0.0
            while True:
                await stream.ready.wait()
                if min_interval_s > 0.0:
                    await stream.wait_until(next_at)
                    next_at = time.monotonic() + min_interval_s
                out = stream.take()
                yield out
                if out.finished:
                    return
        finally:
            if self.streams.get(rid) is stream:  # closed early: the client went away
                self._abort_stream(stream, "abort")

    async def abort(self, request_id: str) -> None:
        s = self.streams.get(request_id)
        if s is not None:
            self._abort_stream(s, "abort")

    def _abort_stream(self, s: _Stream, reason: str) -> None:
        if self.streams.get(s.request_id) is not s:
            return  # exactly once (and never another stream that reuses the id)
        del self.streams[s.request_id]
        live = [c for c in s.children if not c.finished]
        for c in s.children:
            c.fail(reason)
            self._child_to_stream.pop(c.request_id, None)
        if live and self.dead.cause is None:
            try:
                self.client.abort_requests([c.request_id for c in live])
            except EngineDeadError:
                pass  # nothing runs in a dead engine
        # A consumer still waiting (abort() from elsewhere, shutdown) ends now.
        s.put([CompletionOutput(c.index, "", [], reason) for c in live], s.num_cached_tokens)

    # ---- outputs -------------------------------------------------------------------

    def _process(self, outs: EngineCoreOutputs) -> None:
        if outs.engine_error is not None:
            self._fail_all(outs.engine_error)
            return
        if outs.resume is not None:  # after every output delivered before it: resubmit from here
            try:
                self.client.resume(outs.resume.tag, resumed_requests(outs.resume, self._child))
            except EngineDeadError:
                pass  # the engine's own error message fails the streams
        if outs.scheduler_stats is not None:
            self._absorb_stats(outs.scheduler_stats)
        changed: dict[str, list[CompletionOutput]] = {}
        aborts: list[str] = []
        for o in outs.outputs:
            entry = self._child_to_stream.get(o.request_id)
            if entry is None:
                continue
            stream, child = entry
            n_before = len(child.token_ids)
            lp_before = len(child.logprobs) if child.logprobs is not None else 0
            if child.process(o):
                aborts.append(o.request_id)
            self.counters.generation_tokens += len(o.new_token_ids)
            delta = self._delta(child, n_before, lp_before)
            changed.setdefault(stream.request_id, []).append(delta)
            if child.finished:
                reason = child.finish_reason or "stop"
                self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
                self._child_to_stream.pop(o.request_id, None)
        if aborts:
            try:
                self.client.abort_requests(aborts)
            except EngineDeadError:
                pass  # the engine's own error message fails the streams
        for rid, deltas in changed.items():
            target = self.streams.get(rid)
            if target is None:
                continue
            target.put(deltas, max(c.num_cached_tokens for c in target.children))
            if target.finished:
                del self.streams[rid]

    def _child(self, request_id: str) -> RequestState | None:
        entry = self._child_to_stream.get(request_id)
        return entry[1] if entry is not None else None

    @staticmethod
    def _delta(child: RequestState, n_before: int, lp_before: int) -> CompletionOutput:
        text = child.detokenizer.get_delta(stream=True, finished=child.finished) \
            if child.detokenizer is not None else ""
        lps = child.logprobs[lp_before:] if child.logprobs is not None else None
        return CompletionOutput(child.index, text, child.token_ids[n_before:], child.finish_reason,
                                child.stop_reason, lps)

    def _absorb_stats(self, st: SchedulerStats) -> None:
        self.stats = st
        c = self.counters
        c.preemptions = st.num_preemptions
        c.prefix_queries += st.prefix_cache_stats.queries
        c.prefix_hits += st.prefix_cache_stats.hits
        c.structured_requests = max(c.structured_requests, st.num_structured_requests)
        for ms in st.grammar_compile_ms:
            c.grammar_compile.observe(ms / 1e3)
        if st.bitmask_rows:
            c.bitmask_step.observe(st.bitmask_ms / 1e3)
        c.spec_decode.absorb(st)
        c.experts.absorb(st)
        c.kv_tiers.absorb(st)
        c.encoder_cache_hits += st.encoder_cache_hits

    def _fail_all(self, message: str) -> None:
        self.dead.set(message)
        for s in list(self.streams.values()):
            deltas = []
            for c in s.children:
                if not c.finished:
                    c.fail("error", message)
                    deltas.append(CompletionOutput(c.index, "", [], "error", message))
            self.streams.pop(s.request_id, None)
            s.put(deltas, s.num_cached_tokens)
        self._child_to_stream.clear()


async def collect(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Accumulate a delta stream into one final RequestOutput."""
    final: RequestOutput | None = None
    acc: dict[int, CompletionOutput] = {}
    prompt_logprobs = None
    async for ro in gen:
        final = ro
        prompt_logprobs = prompt_logprobs or ro.prompt_logprobs
        for d in ro.outputs:
            acc.setdefault(d.index, CompletionOutput(d.index, "", [])).merge(d)
    assert final is not None
    final.outputs = [acc[k] for k in sorted(acc)]
    final.prompt_logprobs = prompt_logprobs
    return final


