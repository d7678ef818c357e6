"""Prometheus metrics of one serving replica, with vLLM's names under a
`conveyor:` prefix (vllm:num_requests_running -> conveyor:num_requests_running).

Each replica owns its own CollectorRegistry (never the global one), so several
apps can live in one process (tests) and nothing leaks between them.

Sources:
- gauges and cumulative counters are read from the AsyncLLM at scrape time
  (`llm.stats`: the scheduler's stats of the last engine step; `llm.counters`:
  the frontend's cumulative token/finish/prefix-cache counts);
- latency histograms are observed by the HTTP layer through `RequestTimer`;
- worker-group recovery (`conveyor:engine_restarts_total`,
  `conveyor:engine_recovery_seconds`) is cumulative in the core and carried
  by every stats message once the first rebuild happened (`llm.stats.recovery`).

Known approximation: the engine reports no per-request scheduling timestamp,
so `request_queue_time_seconds` is the time from arrival at the replica to
the first engine output for the request (it includes the prefill step).
The scheduler gauges are as of the last engine step: an engine that went idle
through aborts alone keeps its last values until it steps again.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from conveyor.engine.contracts import RecoveryStats
from conveyor.engine.core.recovery import RECOVERY_BUCKETS_S
from conveyor.engine.frontend.kv_tier_counters import BYTES, FAILURES, REUSED, TIER_BLOCKS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "conveyor:"

# vLLM's buckets, extended downwards: a tiny CPU model answers in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _per_index(name: str, doc: str, model_name: str, label: str, values: list[int]) -> CounterMetricFamily:
    """One counter per list index, labelled `label`="i"."""
    m = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", label])
    for i, n in enumerate(values):
        m.add_metric([model_name, str(i)], n)
    return m


class _EngineCollector:
    """Scrape-time view of the engine (a custom collector: no copying of
    counters, so the exported values can never drift from the engine's)."""

    def __init__(self, llm: Any, model_name: str) -> None:
        self.llm, self.model_name = llm, model_name

    def collect(self) -> Iterator[Any]:
        st, c, lab = self.llm.stats, self.llm.counters, [self.model_name]
        # Per-engine series carry an `engine` label (a replica with one
        # engine is engine "0"; with N, the per-engine rows below).
        eng = [self.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "engine"])
            g.add_metric(eng, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "engine"])
            m.add_metric(eng, value)
            return m

        admin = self.llm.client.admin
        if admin is not None:  # data parallel: N engines behind the router
            yield from _engine_rows(admin.metric_rows(), self.model_name)
        yield gauge("num_requests_running", "Requests in the running batch.", st.num_running_reqs)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", st.num_waiting_reqs)
        yield gauge("kv_cache_usage_perc", "KV-cache usage, 1 = full.", st.kv_cache_usage)
        if admin is None:  # with N engines: per engine, above
            yield counter("prefix_cache_queries", "Prefix-cache queries, in tokens.", c.prefix_queries)
            yield counter("prefix_cache_hits", "Prefix-cache hits, in tokens.", c.prefix_hits)
        yield counter("num_preemptions", "Cumulative preemptions.", c.preemptions)
        yield counter("prompt_tokens", "Prefill tokens processed.", c.prompt_tokens)
        yield counter("generation_tokens", "Generation tokens produced.", c.generation_tokens)
        ok = CounterMetricFamily(PREFIX + "request_success", "Finished engine requests.",
                                 labels=["model_name", "finished_reason"])
        for reason, n in sorted(c.finished.items()):
            ok.add_metric([self.model_name, reason], n)
        yield ok
        yield counter("structured_output_requests", "Requests with a structured-output constraint.",
                      c.structured_requests)
        yield _histogram("structured_output_grammar_compile_seconds",
                         "Grammar compile time per structured request.", c.grammar_compile, lab)
        yield _histogram("structured_output_bitmask_seconds",
                         "Grammar bitmask time per step with structured rows.", c.bitmask_step, lab)
        sd = c.spec_decode
        yield counter("spec_decode_num_drafts", "Requests that verified drafts, per step.", sd.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", sd.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      sd.num_accepted_tokens)
        yield _per_index("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, per draft position.",
                         self.model_name, "position", sd.accepted_per_pos)
        if c.experts.routed:  # a mixture of experts
            yield _per_index("moe_routed_tokens", "Tokens routed to each expert.", self.model_name, "expert",
                             c.experts.routed)
        if c.kv_tiers.seen:
            yield from _kv_tier_metrics(c.kv_tiers, self.model_name)
        yield from _encoder_metrics(self.llm, lab)
        if st.lora_running is not None:
            yield from _lora_metrics(st, self.model_name)
        rec = st.recovery  # cumulative, carried by every stats message once set
        yield counter("engine_restarts", "Worker-group rebuilds after a lost rank.",
                      rec.restarts if rec is not None else 0)
        yield _histogram("engine_recovery_seconds", "Time to rebuild the worker group after a lost rank.",
                         _RecoveryHistogram(rec), lab)


def _encoder_metrics(llm: Any, lab: list[str]) -> Iterator[Any]:
    """A vision-language model's encoder cache (DESIGN.md's name, without the conveyor: prefix)."""
    if getattr(getattr(llm, "frontend", None), "images", None) is None:
        return  # a text model (or a stand-in without a frontend)
    hits = CounterMetricFamily("conveyor_encoder_cache_hits", "Images whose encoder output was reused "
                               "from the encoder cache.", labels=["model_name"])
    hits.add_metric(lab, llm.counters.encoder_cache_hits)
    yield hits


def _kv_tier_metrics(kt: Any, model_name: str) -> Iterator[Any]:
    """DESIGN.md's names, without the conveyor: prefix (conveyor_kv_..._total)."""
    reused = CounterMetricFamily(REUSED, "Prompt tokens reused instead of computed, by where their KV "
                                 "came from.", labels=["model_name", "source"])
    for source, n in sorted(kt.reused.items()):
        reused.add_metric([model_name, source], n)
    yield reused
    b = CounterMetricFamily(BYTES, "Bytes moved between the KV pool and its tiers.", labels=["model_name"])
    b.add_metric([model_name], kt.transfer_bytes)
    yield b
    f = CounterMetricFamily(FAILURES, "KV tier transfers that failed (checksum, missing, late, error); "
                            "their blocks were recomputed.", labels=["model_name"])
    f.add_metric([model_name], kt.transfer_failures)
    yield f
    g = GaugeMetricFamily(TIER_BLOCKS, "KV blocks held per tier.", labels=["model_name", "tier"])
    for tier, n in sorted(kt.tier_blocks.items()):
        g.add_metric([model_name, tier], n)
    yield g


def _engine_rows(rows: list[tuple[str, str, dict[str, str], float]], model: str) -> Iterator[Any]:
    """DataParallelClient.metric_rows as metric families (one per name)."""
    families: dict[str, Any] = {}
    for name, kind, lab, value in rows:
        keys = ["model_name", *lab]
        fam = families.get(name)
        if fam is None:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = families[name] = cls(PREFIX + name, name.replace("_", " ") + " (per engine).", labels=keys)
        fam.add_metric([model, *lab.values()], value)
    yield from families.values()
def _lora_metrics(st: Any, model_name: str) -> Iterator[Any]:
    """vLLM's lora_requests_info (adapter names as labels, value = time) and
    running/waiting requests per adapter."""
    info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running and waiting LoRA adapters.",
                             labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    info.add_metric([",".join(sorted(st.lora_running)), ",".join(sorted(st.lora_waiting or {})),
                     str(st.max_loras)], time.time())
    yield info
    for kind, counts in (("running", st.lora_running), ("waiting", st.lora_waiting or {})):
        g = GaugeMetricFamily(PREFIX + f"lora_requests_{kind}", f"Requests {kind}, per LoRA adapter.",
                              labels=["model_name", "lora_name"])
        for name, n in sorted(counts.items()):
            g.add_metric([model_name, name], n)
        yield g


class _RecoveryHistogram:
    """RecoveryStats in the shape _histogram reads."""

    buckets = RECOVERY_BUCKETS_S

    def __init__(self, rec: RecoveryStats | None) -> None:
        self.counts = rec.seconds_buckets if rec is not None else []
        self.total = rec.seconds_sum if rec is not None else 0.0


def _histogram(name: str, doc: str, h: Any, lab: list[str]) -> HistogramMetricFamily:
    m = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
    counts = h.counts or [0] * (len(h.buckets) + 1)
    cum, acc = [], 0
    for bound, n in zip((*map(str, h.buckets), "+Inf"), counts):
        acc += n
        cum.append((bound, acc))
    m.add_metric(lab, cum, sum_value=h.total)
    return m


class ServeMetrics:
    def __init__(self, llm: Any, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        self.registry.register(_EngineCollector(llm, model_name))
        lab = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, lab, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds",
                          "Arrival to first engine output (approximation, see module doc).",
                          TTFT_BUCKETS)
        self.in_progress = Gauge(PREFIX + "api_requests_in_progress",
                                 "HTTP generation requests being handled by this replica.",
                                 lab, registry=self.registry).labels(model_name)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency bookkeeping of one engine request stream (one prompt)."""

    def __init__(self, m: ServeMetrics) -> None:
        self.m = m
        self.start = time.monotonic()
        self.last: float | None = None

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.m.ttft.observe(now - self.start)
            self.m.queue.observe(now - self.start)
        else:
            # One sample per token: an event that carries n tokens (a lagging
            # reader, or serve.stream_batching_interval_ms) spreads its gap.
            gap = (now - self.last) / n
            for _ in range(n):
                self.m.itl.observe(gap)
        self.last = now

    def finish(self) -> None:
        self.m.e2e.observe(time.monotonic() - self.start)
