"""bench/scheduler.py's replay: one run of a peer-harness trace through our
Scheduler with the harness's step protocol and timing method (add arrivals,
timed apart; schedule(), timed; the fake model, untimed; update_from_output(),
timed), gc frozen and off during the loop.
"""
from __future__ import annotations

import gc
import hashlib
import json
import time
from types import ModuleType
from typing import Any

GC_EVERY = 50  # untimed full collection every N steps while gc is disabled (as the peer)
MAX_STEPS = 200_000

perf_ns = time.perf_counter_ns


# ---------------------------------------------------------------------------
# Our scheduler: construction mirrors tests/cpu/sched_utils.py::create_scheduler
# ---------------------------------------------------------------------------
class ConveyorDriver:
    """Builds our Scheduler and its requests as tests/cpu/sched_utils.py does."""
    def __init__(self, log_stats: bool = True) -> None:
        import msgspec

        from conveyor.engine.config import EngineConfig
        from conveyor.engine.contracts import EngineCoreRequest, ModelRunnerOutput
        from conveyor.engine.core.request import Request
        from conveyor.engine.core.scheduler import Scheduler
        from conveyor.engine.sampling_params import SamplingParams

        self.msgspec = msgspec
        self.EngineConfig = EngineConfig
        self.EngineCoreRequest = EngineCoreRequest
        self.ModelRunnerOutput = ModelRunnerOutput
        self.Request = Request
        self.SamplingParams = SamplingParams
        self.Scheduler = Scheduler
        self.log_stats = log_stats

    def build(self, engine: dict) -> Any:
        """A fresh Scheduler with the trace's engine settings (checked)."""
        e = engine
        if e.get("watermark", 0.0) != 0.0:
            raise ValueError("our scheduler has no KV watermark; the trace asks for "
                             f"{e['watermark']}")
        tree = {
            "model": {"max_model_len": e["max_model_len"]},
            "scheduler": {
                "max_num_seqs": e["max_num_seqs"],
                "max_num_batched_tokens": e["max_num_batched_tokens"],
                "enable_chunked_prefill": e["enable_chunked_prefill"],
                "long_prefill_token_threshold": e["long_prefill_token_threshold"],
                "policy": e["policy"],
            },
            "cache": {"block_size": e["block_size"],
                      "enable_prefix_caching": e["enable_prefix_caching"]},
            "parallel": {"pipeline_parallel_size": 1},
        }
        cfg = self.msgspec.convert(tree, self.EngineConfig)
        sched = self.Scheduler(cfg, e["num_blocks"], log_stats=self.log_stats)
        # Sanity: what we asked for is what we got.
        kv = sched.kv_cache_manager
        assert kv.block_pool.num_blocks == e["num_blocks"]
        assert kv.block_pool.get_num_free_blocks() == e["usable_blocks"]
        assert sched.block_size == e["block_size"]
        assert sched.enable_caching == e["enable_prefix_caching"]
        assert sched.max_model_len == e["max_model_len"]
        assert (sched.hasher is not None) == e["enable_prefix_caching"]
        return sched

    def make_request(self, q: dict, eos: int, max_model_len: int) -> Any:
        """A Request of the trace (ignore_eos, its own max_tokens)."""
        sp = self.SamplingParams(max_tokens=q["max_tokens"], ignore_eos=True)
        ecr = self.EngineCoreRequest(request_id=q["req_id"], prompt_token_ids=q["prompt_token_ids"],
                                     sampling_params=sp, eos_token_id=eos,
                                     arrival_time=float(q["index"]))
        return self.Request.from_engine_core_request(ecr, max_model_len)

    def model_output(self, req_ids: list[str], sampled: list[list[int]]) -> Any:
        """The fake model's output for the scheduled requests."""
        return self.ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


# ---------------------------------------------------------------------------
# One run of one trace
# ---------------------------------------------------------------------------
class Replay:
    """One run of one trace on a fresh Scheduler: the requests built up front
    (untimed), as the peer harness does, and the per-step records."""

    def __init__(self, drv: ConveyorDriver, trace: dict, traces: ModuleType) -> None:
        self.trace, self.drv, self.traces = trace, drv, traces
        eng = trace["engine"]
        self.sched = drv.build(eng)
        reqs = trace["requests"]
        self.index_of = {q["req_id"]: q["index"] for q in reqs}
        self.oreqs = [drv.make_request(q, trace["eos_token_id"], eng["max_model_len"]) for q in reqs]
        self.by_id = {r.request_id: r for r in self.oreqs}
        self.by_step: dict[int, list] = {}
        for q, r in zip(reqs, self.oreqs):
            self.by_step.setdefault(q["arrival_step"], []).append(r)
        self.last_arrival = max(self.by_step)
        timing = trace["timing"]
        self.steady = timing["mode"] == "steady_decode"
        self.warm, self.n_timed = timing.get("warmup_steps", 0), timing.get("timed_steps", 0)
        # cpu_ns: this thread's CPU time over schedule()+update (CLOCK_THREAD_CPUTIME_ID,
        # read outside the perf_counter brackets): immune to being descheduled by other
        # processes on the core, which the wall-clock step times are not.
        self.rec: dict[str, list] = dict(sched_ns=[], update_ns=[], cpu_ns=[], add_ns=[], n_reqs=[],
                                         n_tokens=[], running=[], waiting=[], preempted=[])
        self.digest = hashlib.sha256()
        self.preemptions = self.pc_queries = self.pc_hits = self.pc_requests = self.add_total_ns = 0
        self.decode_start: int | None = None
        self.timed_from: int | None = None

    def fake_output(self, so: Any) -> Any:
        """The fake model (untimed): the sampled-token rule for every request
        whose prompt is computed, nothing for the others."""
        seed, tok = self.trace["seed"], self.traces.sampled_token
        req_ids, sampled = list(so.num_scheduled_tokens), []
        for rid in req_ids:
            r = self.by_id[rid]
            done = r.num_computed_tokens >= r.num_tokens
            sampled.append([tok(seed, self.index_of[rid], r.num_output_tokens)] if done else [])
        return self.drv.model_output(req_ids, sampled)

    def record(self, step: int, so: Any, outs: Any, ns: tuple[int, int, int], add_ns: int) -> None:
        """Bookkeeping of one step (untimed): counters, digest, and the timed
        window's records (steady decode: from warm-up's end, for n_timed steps)."""
        sched, nst = self.sched, so.num_scheduled_tokens
        npre = sched.num_preemptions - self.preemptions  # this step's (cumulative counter)
        self.preemptions = sched.num_preemptions
        st = outs.scheduler_stats
        if st is not None and st.prefix_cache_stats is not None:
            pcs = st.prefix_cache_stats  # per-step delta
            self.pc_queries += pcs.queries
            self.pc_hits += pcs.hits
            self.pc_requests += pcs.requests
        self.digest.update((str(step) + ":" + ",".join(f"{k}={v}" for k, v in sorted(nst.items())) + ";").encode())
        if self.steady:
            if self.decode_start is None:
                if all(r.num_output_tokens >= 1 for r in self.oreqs):
                    self.decode_start = step + 1
                    self.timed_from = self.decode_start + self.warm
                return
            if self.timed_from is not None and step < self.timed_from:
                return
        rec = self.rec
        for key, v in zip(("sched_ns", "update_ns", "cpu_ns", "add_ns", "n_reqs", "n_tokens", "running",
                           "waiting", "preempted"),
                          (*ns, add_ns, len(nst), so.total_num_scheduled_tokens, len(sched.running),
                           len(sched.waiting), npre)):
            rec[key].append(v)

    def finished(self, step: int) -> bool:
        """The run is over (steady: the timed window is done; else every request finished)."""
        if self.steady:
            return self.timed_from is not None and step >= self.timed_from + self.n_timed
        return step > self.last_arrival and not self.sched.has_unfinished_requests()

    def result(self, steps: int, loop_ns: int, loop_cpu_ns: int) -> dict:
        """The run's records and totals, after checking it ran as the trace says."""
        oreqs, name = self.oreqs, self.trace["workload"]
        finished = sum(1 for r in oreqs if r.is_finished())
        if self.steady:
            if not all(n == len(oreqs) for n in self.rec["n_reqs"]):
                raise AssertionError(f"{name}: not all {len(oreqs)} requests scheduled in a timed decode step")
            if not all(n == len(oreqs) for n in self.rec["n_tokens"]):
                raise AssertionError(f"{name}: non-decode step in the timed window")
        elif finished != len(oreqs):
            raise AssertionError(f"{name}: {finished} of {len(oreqs)} requests finished")
        return dict(
            rec=self.rec, steps_total=steps, decode_start_step=self.decode_start, preemptions=self.preemptions,
            preemptions_by_request=sum(r.num_preemptions for r in oreqs),
            scheduler_num_preemptions=self.sched.num_preemptions, finished=finished,
            prefix_cache=dict(requests=self.pc_requests, queries=self.pc_queries, hits=self.pc_hits),
            loop_wall_ms=round(loop_ns / 1e6, 2), loop_cpu_ms=round(loop_cpu_ns / 1e6, 2),
            add_total_ns=self.add_total_ns, schedule_digest=self.digest.hexdigest(),
            output_tokens=sum(r.num_output_tokens for r in oreqs),
            output_digest=hashlib.sha256(json.dumps([r.output_token_ids for r in oreqs]).encode()).hexdigest())


def run_trace(drv: ConveyorDriver, trace: dict, traces: ModuleType, prof: Any = None) -> dict:
    """Replay ``trace`` once on a fresh Scheduler; return per-step records.

    With ``prof`` (a cProfile.Profile) the profiler is switched on around the
    add/schedule/update calls only (the times recorded are then meaningless)."""
    rp = Replay(drv, trace, traces)
    sched, by_step, cpu_now = rp.sched, rp.by_step, time.thread_time_ns
    p_on = prof.enable if prof is not None else (lambda: None)
    p_off = prof.disable if prof is not None else (lambda: None)
    step = 0
    gc.collect()
    gc.freeze()
    gc.disable()
    loop_t0, loop_c0 = perf_ns(), time.thread_time_ns()
    try:
        while True:
            arrivals, add_ns = by_step.get(step), 0  # -- arrivals (timed separately) --
            if arrivals:
                p_on()
                t = perf_ns()
                for r in arrivals:
                    sched.add_request(r)
                add_ns = perf_ns() - t
                p_off()
                rp.add_total_ns += add_ns
            p_on()  # -- schedule --
            c0, t0 = cpu_now(), perf_ns()
            so = sched.schedule()
            t1, c1 = perf_ns(), cpu_now()
            p_off()
            mro = rp.fake_output(so)  # -- fake model (untimed) --
            p_on()  # -- update --
            c2, t2 = cpu_now(), perf_ns()
            outs = sched.update_from_output(so, mro)
            t3, c3 = perf_ns(), cpu_now()
            p_off()
            rp.record(step, so, outs, (t1 - t0, t3 - t2, c1 - c0 + c3 - c2), add_ns)
            step += 1
            if step % GC_EVERY == 0:
                gc.collect()
            if rp.finished(step):
                break
            if step >= MAX_STEPS:
                raise RuntimeError(f"{trace['workload']}: no progress after {step} steps")
    finally:
        loop_ns, loop_cpu_ns = perf_ns() - loop_t0, time.thread_time_ns() - loop_c0
        gc.unfreeze()
        gc.enable()
    return rp.result(step, loop_ns, loop_cpu_ns)
