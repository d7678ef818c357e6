"""Property test (hypothesis) of the scheduler with the tier KV connector.

A state machine drives one scheduler whose pool is tiny (blocks are evicted
into the host / disk tiers all the time) against a fake worker that keeps,
per pool block, host slot and disk file, the block key its bytes really
belong to. Loads succeed, fail (a bad checksum, a missing file), or come
late (reported steps later, possibly after the request's deadline); saves
fail; requests are aborted, preempted and time out. Some requests carry a
KVTransfer (another engine's blocks: P/D, a move, a peer pull) or lease
their blocks on finishing (a prefill leg). Checked:
- no step ever computes on a block whose bytes are not the block the
  scheduler counts as computed (no wrong KV, whatever the tier did);
- every save reads a block that holds what its key says (only computed KV moves down);
- block ref counts equal their holders (requests, parked requests, orphans);
- at the end every admitted request finished exactly once, every block is
  free, and nothing stays pinned, parked, orphaned, leased or in flight.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sched_utils import EOS, fake_output, make_request, scripted_token

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import ModelRunnerOutput, RequestStatus, SchedulerOutput
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.kv_connector.metadata import (
    TIER_CPU,
    TIER_REMOTE,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransfer,
    TierLoad,
)
from conveyor.engine.kv_connector.spec import TierSpec
from conveyor.engine.kv_connector.tiers import TierConnectorScheduler

MAX_DRAIN_STEPS = 3000
TIMEOUT_S = 10.0
COVERAGE: Counter[str] = Counter()
SHRINK = os.environ.get("CONVEYOR_HYPOTHESIS_SHRINK") == "1"  # on a failure, when debugging
PREFIXES = [[7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9, 10, 20, 21, 22, 23], [30] * 12, []]


@dataclass(frozen=True)
class Shape:
    block_size: int
    num_blocks: int
    cpu_blocks: int
    disk_blocks: int
    budget: int
    depth: int


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    return Shape(block_size=draw(st.sampled_from([2, 4])), num_blocks=draw(st.integers(4, 10)),
                 cpu_blocks=draw(st.sampled_from([0, 1, 3, 8])), disk_blocks=draw(st.sampled_from([0, 2, 16])),
                 budget=draw(st.integers(8, 32)), depth=draw(st.sampled_from([1, 2])))


class FakeTierWorker:
    """The bytes' truth: which block key each pool block, host slot and disk file holds."""

    def __init__(self) -> None:
        self.pool: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.disk: dict[bytes, bytes] = {}
        self.late: list[tuple[TierLoad, bool]] = []  # (load, succeeds when it arrives)
        self.out = KVConnectorOutput()

    def start(self, meta: KVConnectorMetadata | None, fate: dict[str, str]) -> None:
        if meta is None:
            return
        for d in meta.demotes:
            if self.host.get(d.slot) == d.key:
                self.disk[d.key] = d.key
                self.out.disk_saved.append(d.key)
            else:
                self.out.failed_saves.append(d.key)
        for key in meta.disk_deletes:
            self.disk.pop(key, None)
        for s in meta.disk_saves:
            assert self.pool.get(s.block_id) == s.key, "a save read a block that is not what its key says"
            if fate.get("save") == "fail":
                self.out.failed_saves.append(s.key)
            else:
                self.disk[s.key] = self.pool[s.block_id]
                self.out.disk_saved.append(s.key)
        for s in meta.cpu_saves:
            assert self.pool.get(s.block_id) == s.key, "a save read a block that is not what its key says"
            self.host[s.slot] = self.pool[s.block_id] if fate.get("save") != "fail" else b"garbage"
        for ld in meta.loads:
            how = fate.get("load", "ok")
            if how == "late":
                self.late.append((ld, True))
                COVERAGE["late"] += 1
            else:
                self._load(ld, ok=how == "ok")

    def _load(self, ld: TierLoad, ok: bool) -> None:
        self.out.finished_loads.append(ld.load_id)
        for key, tier, slot, block in zip(ld.keys, ld.tiers, ld.slots, ld.block_ids):
            # Another engine's file (TIER_REMOTE) holds what its key says; the fate fails it.
            got = self.host.get(slot) if tier == TIER_CPU else key if tier == TIER_REMOTE else self.disk.get(key)
            COVERAGE["remote_block"] += tier == TIER_REMOTE
            if not ok or got != key:  # the worker's checksum / header check
                self.out.invalid_block_ids.append(block)
                COVERAGE["invalid"] += 1
                return
            self.pool[block] = got
            COVERAGE["loaded_block"] += 1

    def deliver_late(self) -> None:
        late, self.late = self.late, []
        for ld, ok in late:
            self._load(ld, ok)

    def forward(self, so: SchedulerOutput, s: Scheduler) -> None:
        """Check the computed prefix of every scheduled request, then write its new blocks."""
        computed = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        bs = s.block_size
        # One forward writes every row's new KV before any attention reads it
        # (a request may hit blocks another computes in the same step).
        for rid, n in so.num_scheduled_tokens.items():
            req, c = s.requests[rid], computed[rid]
            blocks = s.kv_cache_manager.req_to_blocks[rid]
            for i in range(c // bs, min((c + n) // bs, len(req.block_hashes))):
                self.pool[blocks[i].block_id] = req.block_hashes[i]
        for rid in so.num_scheduled_tokens:
            req, c = s.requests[rid], computed[rid]
            blocks = s.kv_cache_manager.req_to_blocks[rid]
            for i in range(c // bs):
                assert self.pool.get(blocks[i].block_id) == req.block_hashes[i], \
                    f"{rid} computes on block {i} whose KV is not its own"

    def take(self) -> KVConnectorOutput:
        out, self.out = self.out, KVConnectorOutput()
        return out


class ConnectorMachine(RuleBasedStateMachine):
    @initialize(shape=shapes())
    def setup(self, shape: Shape) -> None:
        self.shape = shape
        bs = shape.block_size
        cap = (shape.num_blocks - 1) * bs
        tree = {"model": {"max_model_len": cap},
                "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": shape.budget},
                "cache": {"block_size": bs, "enable_prefix_caching": True, "kv_load_timeout_s": TIMEOUT_S}}
        cfg = msgspec.convert(tree, EngineConfig)
        spec = TierSpec(block_size=bs, bytes_per_block=1, cpu_blocks=shape.cpu_blocks,
                        disk_blocks=shape.disk_blocks, disk_folder=Path("/nonexistent/conveyor-kvp"), model_id="",
                        load_timeout_s=TIMEOUT_S)
        self.conn = TierConnectorScheduler(spec)
        self.conn.clock = lambda: self.now
        self.s = Scheduler(cfg, shape.num_blocks, connector=self.conn)
        self.now = 0.0
        assert self.s.remote_kv is not None
        self.s.remote_kv.clock = lambda: self.now
        self.worker = FakeTierWorker()
        self.in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        self.added: list[str] = []
        self.finishes: Counter[str] = Counter()
        self.token_k: Counter[str] = Counter()
        self.limit = cap

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(2, 5), max_size=6),
          max_tokens=st.integers(1, 8), remote=st.sampled_from([0, 0, 1, 3]), lease=st.booleans())
    def add(self, prefix: list[int], suffix: list[int], max_tokens: int, remote: int, lease: bool) -> None:
        prompt = ((prefix + suffix) or [3])[:self.limit - 1]
        rid = f"r{len(self.added)}"
        req = make_request(rid, prompt, max_tokens=min(max_tokens, self.limit - len(prompt)),
                           arrival_time=float(len(self.added)), max_model_len=self.limit)
        if remote:
            req.kv_transfer = KVTransfer("prefill", remote)
        req.kv_lease_s = 5.0 if lease else 0.0
        self.s.add_request(req)
        self.added.append(rid)

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.finishes[rid] += 1

    @precondition(lambda self: hasattr(self, "s") and bool(self.s.remote_kv.parked))
    @rule(data=st.data())
    def abort_parked(self, data: st.DataObject) -> None:
        """Aborted while its load is in flight: the blocks wait for the load."""
        assert self.s.remote_kv is not None
        rid = data.draw(st.sampled_from(sorted(self.s.remote_kv.parked)))
        self.s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.finishes[rid] += 1
        COVERAGE["abort_parked"] += 1

    @rule()
    def time_passes(self) -> None:
        self.now += TIMEOUT_S + 1  # every parked request is past its deadline at the next schedule

    @precondition(lambda self: len(self.in_flight) < self.shape.depth and self.s.has_requests())
    @rule(load=st.sampled_from(["ok", "fail", "late"]), save=st.sampled_from(["ok", "ok", "ok", "fail"]),
          late_arrives=st.sampled_from([True, False, False]), data=st.data())
    def schedule(self, load: str, save: str, late_arrives: bool, data: st.DataObject) -> None:
        self._step({"load": load, "save": save}, late_arrives, lambda ids: data.draw(st.sets(st.sampled_from(ids))))

    @precondition(lambda self: bool(self.in_flight))
    @rule()
    def complete(self) -> None:
        self._deliver(*self.in_flight.pop(0))

    # ---- invariants -----------------------------------------------------------------

    @invariant()
    def blocks_are_conserved(self) -> None:
        if not hasattr(self, "s"):
            return
        kv, rk = self.s.kv_cache_manager, self.s.remote_kv
        assert rk is not None
        held: Counter[int] = Counter()
        for rid, blocks in kv.req_to_blocks.items():
            assert rid in self.s.requests, f"{rid} holds blocks after it finished"
            held.update(b.block_id for b in blocks)
        for blocks in rk.orphans.values():
            held.update(b.block_id for b in blocks)
        for b in kv.block_pool.blocks[1:]:
            assert b.ref_cnt == held[b.block_id], (b, held[b.block_id])
        for rid, p in rk.parked.items():
            assert p.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            assert p.request not in self.s.running and rid not in {r.request_id for r in self.s.waiting}
        assert len(self.conn.cpu) <= self.shape.cpu_blocks and len(self.conn.disk) <= self.shape.disk_blocks
        COVERAGE["leased"] += bool(self.conn._leases)

    # ---- the end --------------------------------------------------------------------

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        for i in range(MAX_DRAIN_STEPS):
            if self.in_flight:
                self._deliver(*self.in_flight.pop(0))
            elif self.s.has_requests() or self.worker.late:
                # The drain keeps failing loads, making them late and letting
                # deadlines pass; it must still end.
                self.now += TIMEOUT_S + 1 if i % 7 == 6 else 1.0
                fate = {"load": ("ok", "late", "fail")[i % 3], "save": "fail" if i % 5 == 4 else "ok"}
                self._step(fate, i % 2 == 0 or i > MAX_DRAIN_STEPS // 2, lambda ids: set())
            else:
                break
        else:
            rk = self.s.remote_kv
            raise AssertionError(f"not drained: running {[r.request_id for r in self.s.running]}, waiting "
                                 f"{[(r.request_id, r.num_computed_tokens, r.num_tokens) for r in self.s.waiting]}, "
                                 f"parked {list(rk.parked) if rk else None}, orphans {list(rk.orphans) if rk else None}, "
                                 f"late {len(self.worker.late)}, free {self.s.kv_cache_manager.get_num_free_blocks()}, "
                                 f"pending {self.conn.has_pending()}")
        self.blocks_are_conserved()
        self.now += 10.0  # past every lease; the next step ends them
        self.s.schedule()
        rk = self.s.remote_kv
        assert rk is not None and not rk.parked and not rk.orphans
        assert not self.s.requests and self.finishes == Counter(self.added)
        pool = self.s.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.shape.num_blocks - 1
        assert self.conn.num_inflight_loads == 0 and not self.conn.cpu.pinned and not self.conn.disk.pinned
        assert not self.conn.disk.held and not self.conn._leases
        COVERAGE["finished"] += len(self.added)
        COVERAGE["preemption"] += self.s.num_preemptions
        COVERAGE["timeouts"] += rk.total_timeouts

    # ---- helpers ----------------------------------------------------------------------

    def _step(self, fate: dict[str, str], late_arrives: bool, eos_of) -> None:  # type: ignore[no-untyped-def]
        so = self.s.schedule()
        if late_arrives:
            self.worker.deliver_late()
        self.worker.start(so.kv_connector_metadata, fate)
        self.worker.forward(so, self.s)
        for blk in self.s.kv_cache_manager.block_pool.blocks[1:]:  # a prefix hit is what its hash says
            assert blk.block_hash is None or self.worker.pool.get(blk.block_id) == blk.block_hash, blk
        ids = sorted(so.num_scheduled_tokens)
        eos = eos_of(ids) if ids else set()
        mro = fake_output(so, self.s, lambda rid: self._token(rid, eos))
        mro.kv_connector_output = self.worker.take()
        COVERAGE["tier_hit"] += sum(nr.num_computed_tokens > 0 for nr in so.scheduled_new_reqs)
        self.in_flight.append((so, mro))

    def _token(self, rid: str, eos: set[str]) -> int:
        if rid in eos:
            return EOS
        self.token_k[rid] += 1
        return scripted_token(rid, self.token_k[rid])

    def _deliver(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        for o in self.s.update_from_output(so, mro).outputs:
            assert self.finishes[o.request_id] == 0, f"output for {o.request_id} after it finished"
            if o.finish_reason is not None:
                self.finishes[o.request_id] += 1


def test_scheduler_with_tier_connector_properties():
    COVERAGE.clear()
    run_state_machine_as_test(ConnectorMachine, settings=settings(
        max_examples=int(os.environ.get("KVP_EXAMPLES", "200")), stateful_step_count=50, deadline=None, database=None,
        derandomize=True, suppress_health_check=list(HealthCheck),
        phases=[p for p in Phase if p != Phase.shrink or SHRINK]))
    for what in ("loaded_block", "remote_block", "leased", "invalid", "late", "timeouts", "abort_parked", "preemption",
                 "finished"):
        assert COVERAGE[what] > 0, (what, COVERAGE)


def test_a_loaded_prefix_is_not_counted_twice():
    """Found by the machine above: a request back from a load (2 tokens) whose
    rest does not fit one step's budget (8 of 10) must hash only the blocks
    the step computes. It hashed one block more (its load counted twice), a
    block another request could then hit before its KV was written."""
    m = ConnectorMachine()
    m.setup(Shape(block_size=2, num_blocks=8, cpu_blocks=0, disk_blocks=0, budget=8, depth=1))
    m.add(prefix=[30] * 12, suffix=[], max_tokens=1, remote=1, lease=False)
    for _ in range(2):  # the load; then 8 tokens computed on top of it
        m._step({"load": "ok", "save": "ok"}, False, lambda ids: set())
        m._deliver(*m.in_flight.pop(0))
    blocks = m.s.kv_cache_manager.req_to_blocks["r0"]
    assert sum(b.block_hash is not None for b in blocks) == 5 and len(blocks) == 5
