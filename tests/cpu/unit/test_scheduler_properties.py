"""Property tests (hypothesis) for Scheduler + KVCacheManager.

A state machine drives one scheduler with fake model outputs: random
arrivals (prompts that share prefixes), aborts at any time (also while a step
is in flight), EOS at random, one or two steps in flight, tiny pools (so
requests are preempted) and every scheduler shape the config allows. After
every rule:
- a block's ref count equals the number of requests that hold it;
- a block is in the free queue iff nobody holds it (never both), the null
  block is neither, and the prefix-cache map agrees with the blocks' hashes;
- running and waiting partition the live requests;
and at the end (all work drained) every request finished exactly once and
every block is free."""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sched_utils import EOS, create_scheduler, fake_output, make_request, scripted_token

from conveyor.engine.contracts import ModelRunnerOutput, RequestStatus, SchedulerOutput

MAX_DRAIN_STEPS = 5000  # a drain that takes longer is a livelock
COVERAGE: Counter[str] = Counter()  # what the runs exercised, checked at the end


@dataclass(frozen=True)
class Shape:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    budget: int
    chunked: bool
    threshold: int
    policy: str
    caching: bool
    depth: int  # steps in flight at once (2: the batch queue of PP / async scheduling)

    @property
    def max_model_len(self) -> int:
        # One request alone always fits the pool (the core rejects the others at add time).
        cap = (self.num_blocks - 1) * self.block_size
        return min(cap, self.budget) if not self.chunked else cap


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    block_size = draw(st.sampled_from([2, 4, 8]))
    chunked = draw(st.booleans())
    return Shape(block_size=block_size, num_blocks=draw(st.integers(3, 12)),
                 max_num_seqs=draw(st.integers(1, 4)), budget=draw(st.integers(8, 48)),
                 chunked=chunked, threshold=draw(st.sampled_from([0, 0, 5])) if chunked else 0,
                 policy=draw(st.sampled_from(["fcfs", "priority"])), caching=draw(st.booleans()),
                 depth=draw(st.sampled_from([1, 2])))


PREFIXES = [[], [7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9, 10, 20, 21], [30] * 16]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(shape=shapes())
    def setup(self, shape: Shape) -> None:
        self.shape = shape
        self.s = create_scheduler(
            num_blocks=shape.num_blocks, block_size=shape.block_size,
            max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=shape.budget,
            enable_prefix_caching=shape.caching, max_model_len=shape.max_model_len,
            enable_chunked_prefill=shape.chunked, long_prefill_token_threshold=shape.threshold,
            policy=shape.policy)
        self.kv = self.s.kv_cache_manager
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.added: list[str] = []
        self.finishes: Counter[str] = Counter()
        self.token_k: Counter[str] = Counter()
        self.next_id = 0

    # ---- rules --------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(2, 5), max_size=12),
          max_tokens=st.integers(1, 12), priority=st.integers(0, 2),
          salt=st.sampled_from([None, None, "a"]))
    def add(self, prefix: list[int], suffix: list[int], max_tokens: int, priority: int,
            salt: str | None) -> None:
        prompt = (prefix + suffix) or [3]
        limit = self.shape.max_model_len
        prompt = prompt[:limit - 1]
        max_tokens = min(max_tokens, limit - len(prompt))
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.s.add_request(make_request(rid, prompt, max_tokens=max_tokens, priority=priority,
                                        arrival_time=float(self.next_id), cache_salt=salt,
                                        max_model_len=limit))
        self.added.append(rid)

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.finishes[rid] += 1
        COVERAGE["abort"] += 1

    @precondition(lambda self: len(self.in_flight) < self.shape.depth and self.s.has_requests())
    @rule(data=st.data())
    def schedule(self, data: st.DataObject) -> None:
        so = self.s.schedule()
        assert so.total_num_scheduled_tokens <= self.shape.budget
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        COVERAGE["prefix_hit"] += sum(nr.num_computed_tokens > 0 for nr in so.scheduled_new_reqs)
        ids = sorted(so.num_scheduled_tokens)
        eos = data.draw(st.sets(st.sampled_from(ids))) if ids else set()
        self.in_flight.append((so, fake_output(so, self.s, lambda rid: self._token(rid, eos))))

    @precondition(lambda self: bool(self.in_flight))
    @rule()
    def complete(self) -> None:
        so, mro = self.in_flight.popleft()
        self._deliver(so, mro)

    # ---- invariants -----------------------------------------------------------------

    @invariant()
    def blocks_are_conserved(self) -> None:
        if not hasattr(self, "kv"):
            return
        pool = self.kv.block_pool
        held: Counter[int] = Counter()
        for rid, blocks in self.kv.req_to_blocks.items():
            req = self.s.requests.get(rid)
            assert req is not None, f"{rid} holds blocks after it finished"
            if blocks:
                assert req.status == RequestStatus.RUNNING, (rid, req.status)
                assert len(blocks) * self.shape.block_size >= req.num_computed_tokens
            held.update(b.block_id for b in blocks)
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free) == len(set(free)) == pool.get_num_free_blocks()
        assert pool.null_block.block_id not in held and pool.null_block.block_id not in free
        for b in pool.blocks[1:]:
            assert b.ref_cnt == held[b.block_id], (b, held[b.block_id])
            assert (b.block_id in free) == (b.ref_cnt == 0), b
        for h, entry in pool.cached_block_hash_to_block.items():
            assert entry and all(b.block_hash == h for b in entry.values())
        hashed = {b.block_id for b in pool.blocks if b.block_hash is not None}
        assert hashed == {i for e in pool.cached_block_hash_to_block.values() for i in e}

    @invariant()
    def queues_partition_the_live_requests(self) -> None:
        if not hasattr(self, "s"):
            return
        running = [r.request_id for r in self.s.running]
        waiting = [r.request_id for r in self.s.waiting]
        assert len(running) <= self.shape.max_num_seqs
        assert sorted(running + waiting) == sorted(self.s.requests), (running, waiting)
        assert all(r.status == RequestStatus.RUNNING for r in self.s.running)
        assert all(self.finishes[rid] == 0 for rid in self.s.requests)

    # ---- the end --------------------------------------------------------------------

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        for _ in range(MAX_DRAIN_STEPS):
            if self.in_flight:
                self._deliver(*self.in_flight.popleft())
            elif self.s.has_requests():
                so = self.s.schedule()
                self.in_flight.append((so, fake_output(so, self.s, lambda rid: self._token(rid, set()))))
            else:
                break
        else:
            raise AssertionError(f"not drained after {MAX_DRAIN_STEPS} steps: "
                                 f"{len(self.s.running)} running, {len(self.s.waiting)} waiting")
        self.blocks_are_conserved()
        assert not self.s.requests and not self.kv.req_to_blocks
        assert self.finishes == Counter(self.added), "a request did not finish exactly once"
        pool = self.kv.block_pool
        assert pool.get_num_free_blocks() == self.shape.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        COVERAGE["finished"] += len(self.added)
        COVERAGE["preemption"] += self.s.num_preemptions

    # ---- helpers ----------------------------------------------------------------------

    def _token(self, rid: str, eos: set[str]) -> int:
        if rid in eos:
            return EOS
        self.token_k[rid] += 1
        return scripted_token(rid, self.token_k[rid])

    def _deliver(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        outs = self.s.update_from_output(so, mro)
        for o in outs.outputs:
            assert self.finishes[o.request_id] == 0, f"output for {o.request_id} after it finished"
            if o.finish_reason is not None:
                self.finishes[o.request_id] += 1


def test_scheduler_and_kv_cache_properties():
    COVERAGE.clear()
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=150, stateful_step_count=40, deadline=None, database=None,
        derandomize=True, suppress_health_check=list(HealthCheck)))
    # The runs reached the interesting paths, not just the easy ones.
    assert COVERAGE["preemption"] > 0 and COVERAGE["abort"] > 0, COVERAGE
    assert COVERAGE["prefix_hit"] > 0 and COVERAGE["finished"] > 100, COVERAGE
