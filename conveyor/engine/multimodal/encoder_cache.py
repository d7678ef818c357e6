"""The scheduler's side of the encoder stage (vLLM V1's EncoderCacheManager
and _try_schedule_encoder_inputs).

Each image's encoder output (`length` rows) lives in the workers' encoder
cache under its `mm_hash`; this class is the one record of what is there.
- An output is computed once: a request whose image is cached (its own
  earlier chunk, another request with the same image, or its own run before
  a preemption) references it instead of recomputing (a hit when it is
  another request's or a left-over one).
- It is kept while any request references it. A request lets go of an image
  once its computed prefix passes the image's last placeholder, or when it
  finishes or is preempted. An output nobody references stays cached
  ("freeable") until its space is needed, oldest first.
- An eviction is sent to the workers in the next SchedulerOutput
  (`free_encoder_mm_hashes`), which they apply before computing that step's
  encoder inputs.
Space is counted in encoder output rows (`multimodal.encoder_cache_tokens`);
the work of one step in rows too (`scheduler.max_num_encoder_input_tokens`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.engine.core.request import Request
    from conveyor.engine.core.step_output import StepPlan


class EncoderCacheManager:
    def __init__(self, cache_size: int, compute_budget: int) -> None:
        self.cache_size = cache_size
        self.compute_budget = compute_budget
        self.num_free = cache_size  # rows held by no image
        self.cached: dict[str, set[str]] = {}  # mm_hash -> ids of the requests referencing it
        self.rows: dict[str, int] = {}  # mm_hash -> its rows
        self.freeable: OrderedDict[str, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.freed: list[str] = []  # evicted since the last SchedulerOutput
        self.hits = 0  # since the last take_hits()
        # Hits of requests fitted this step whose KV is not yet allocated: they
        # count at commit (a request that waits is fitted, and would count, again).
        self._pending_hits: dict[str, int] = {}

    # ---- one step's plan -------------------------------------------------------

    def fit(self, request: Request, num_computed: int, num_new: int, plan: StepPlan) -> int:
        """How many of num_new tokens the request may compute this step: an
        image its tokens [num_computed, num_computed + num_new) meet that is
        not cached and does not fit the step's encoder budget or the cache
        cuts num_new to the tokens before it (0: the request waits). Cached
        images are referenced here; the images to compute wait in
        plan.encoder_pending until `commit`, once the request's KV blocks are."""
        if not request.mm_features:
            return num_new
        to_run, num_new, plan.encoder_budget = self._fit(request, num_computed, num_new,
                                                         plan.encoder_budget)
        if self._pending_hits.get(request.request_id) == 0:
            del self._pending_hits[request.request_id]
        if to_run:
            plan.encoder_pending[request.request_id] = to_run
        return num_new

    def commit(self, request: Request, plan: StepPlan) -> None:
        """The request got its KV blocks: its pending images are computed this step."""
        self.hits += self._pending_hits.pop(request.request_id, 0)
        to_run = plan.encoder_pending.pop(request.request_id, None)
        if to_run:
            self.allocate(request, to_run)
            plan.encoder_inputs[request.request_id] = to_run

    def _fit(self, request: Request, num_computed: int, num_new: int,
             budget: int) -> tuple[list[int], int, int]:
        """(indices of the images to compute, num_new, the budget left)."""
        to_run: list[int] = []
        rows = 0
        end = num_computed + num_new
        rid = request.request_id
        self._pending_hits[rid] = 0
        for i, f in enumerate(request.mm_features):
            if f.offset >= end:
                break
            if f.end <= num_computed:
                continue  # its positions are computed (earlier chunks, or prefix-cache hits)
            refs = self.cached.get(f.mm_hash)
            if refs is not None:
                if rid not in refs:
                    self._reference(f.mm_hash, rid)
                    self._pending_hits[rid] += 1
                continue
            if any(request.mm_features[j].mm_hash == f.mm_hash for j in to_run):
                continue  # the same image twice in one prompt: computed once
            if f.length > budget or not self._make_room(rows + f.length):
                # Stop before the image; one whose start is computed already
                # (a prefix-cache hit ending inside it) stops the request.
                return to_run, max(f.offset - num_computed, 0), budget
            to_run.append(i)
            rows += f.length
            budget -= f.length
        return to_run, num_new, budget

    def allocate(self, request: Request, inputs: list[int]) -> None:
        for i in inputs:
            f = request.mm_features[i]
            self.cached[f.mm_hash] = {request.request_id}
            self.rows[f.mm_hash] = f.length
            self.num_free -= f.length
        assert self.num_free >= 0, "encoder cache over-committed"

    def _reference(self, mm_hash: str, rid: str) -> None:
        refs = self.cached[mm_hash]
        if not refs:
            del self.freeable[mm_hash]
        refs.add(rid)

    def _make_room(self, rows: int) -> bool:
        """Evict unreferenced outputs (oldest first) until `rows` are free;
        False (nothing evicted) when even all of them would not make room."""
        if rows <= self.num_free:
            return True
        if rows > self.num_free + sum(self.rows[h] for h in self.freeable):
            return False
        while rows > self.num_free:
            h, _ = self.freeable.popitem(last=False)
            del self.cached[h]
            self.num_free += self.rows.pop(h)
            self.freed.append(h)
        return True

    # ---- letting go ------------------------------------------------------------

    def release_passed(self, request: Request) -> None:
        """Drop the request's references to images its computed prefix has
        passed (an image that comes again later in the prompt stays)."""
        n = request.num_computed_tokens
        ahead = {f.mm_hash for f in request.mm_features if f.end > n}
        for f in request.mm_features:
            if f.end > n:
                break
            if f.mm_hash not in ahead:
                self._release(f.mm_hash, request.request_id)

    def free(self, request: Request) -> None:
        """The request finished, was preempted or waits: it references nothing."""
        self._pending_hits.pop(request.request_id, None)
        for f in request.mm_features:
            self._release(f.mm_hash, request.request_id)

    def _release(self, mm_hash: str, rid: str) -> None:
        refs = self.cached.get(mm_hash)
        if refs is None or rid not in refs:
            return
        refs.discard(rid)
        if not refs:
            self.freeable[mm_hash] = None

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def take_hits(self) -> int:
        hits, self.hits = self.hits, 0
        return hits
