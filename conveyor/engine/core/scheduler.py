"""The token-budget scheduler (vLLM V1's catch-up rule).

There are no prefill or decode phases: each step every request is given up to
`num_tokens - num_computed_tokens` tokens so its computed prefix catches up
with its known tokens, within the step's token budget and the KV cache.
Running requests go first; waiting ones are admitted only when nothing was
preempted this step. num_computed_tokens advances at schedule time, so a
request whose output is still in flight gets 0 tokens and is skipped: that is
what lets the batch queue keep several steps in flight.
"""
from __future__ import annotations

import time
from collections import Counter

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    GrammarOutput,
    ModelRunnerOutput,
    RecoveryStats,
    RequestStatus,
    SchedulerOutput,
    SchedulerStats,
    add_per_index,
)
from conveyor.engine.core.async_scheduling import add_placeholders, at_length_cap
from conveyor.engine.core.remote_kv import RemoteKVWaits, spill_held
from conveyor.engine.core.request import Request
from conveyor.engine.core.request_queue import make_queue
from conveyor.engine.core.stats_parts import kv_stats, structured_stats
from conveyor.engine.core.step_output import OutputExtras, StepPlan, grammar_bitmask, logprobs_for, make_output
from conveyor.engine.core.stopping import check_stop, grammar_done
from conveyor.engine.kv_cache import BlockHasher, KVCacheBlock, KVCacheManager
from conveyor.engine.kv_connector.base import KVConnectorScheduler
from conveyor.engine.lora import lora_stats
from conveyor.engine.multimodal.encoder_cache import EncoderCacheManager
from conveyor.engine.spec_decode.scheduling import SpecDecodeScheduling
from conveyor.engine.structured_output.manager import StructuredOutputManager

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
_WAITING_FOR_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, log_stats: bool = True,
                 structured_output_manager: StructuredOutputManager | None = None,
                 connector: KVConnectorScheduler | None = None) -> None:
        sc, cc = config.scheduler, config.cache
        self.config = config
        self.max_num_seqs = sc.max_num_seqs
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.enable_chunked_prefill = sc.enable_chunked_prefill
        self.long_prefill_token_threshold = sc.long_prefill_token_threshold
        self.policy = sc.policy
        self.max_model_len = config.max_model_len
        self.block_size = cc.block_size
        self.enable_caching = cc.enable_prefix_caching
        self.log_stats = log_stats
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size, self.max_model_len,
                                               cc.enable_prefix_caching)
        self.hasher = BlockHasher(cc.block_size) if cc.enable_prefix_caching else None
        # Non-last PP stages never see sampled tokens: ship them in the diff.
        self.send_new_token_ids = config.parallel.pipeline_parallel_size > 1
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(sc.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Set by EngineCore after a worker-group rebuild; every stats message carries it.
        self.recovery_stats: RecoveryStats | None = None
        self.structured_output_manager = structured_output_manager
        # Requests that ended outside a step (their grammar failed to compile):
        # reported with the next step's outputs.
        self._error_outputs: list[EngineCoreOutput] = []
        self._expert_tokens: list[int] = []  # mixtures of experts: routed since the last stats
        self.spec = (SpecDecodeScheduling(config.speculative, self.max_model_len)
                     if config.speculative.enabled else None)
        # LoRA slots on the workers: running requests never use more distinct adapters.
        self.max_loras = config.lora.max_loras if config.lora.enable else 0
        # Set by EngineCore when it plans a step while the previous one runs.
        self.async_scheduling = False
        # KV beyond the pool (conveyor/engine/kv_connector/): None = the pool alone.
        self.connector = connector
        self.remote_kv = RemoteKVWaits(connector, cc.kv_load_timeout_s) if connector is not None else None
        self.kv_reused: Counter[str] = Counter()  # tokens reused per source since the last stats
        self.prompt_tokens_computed = 0  # cumulative: prompt positions computed, not reused
        self._hook_connector()
        self.encoder = EncoderCacheManager(config.multimodal.encoder_cache_tokens,
                                           sc.max_num_encoder_input_tokens)

    def _hook_connector(self) -> None:
        if self.connector is not None:  # evicted blocks move down instead of vanishing
            self.kv_cache_manager.block_pool.on_evict = self.connector.on_block_evicted

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if self.hasher is not None and not request.block_hashes:
            self.hasher.extend(request)
        so = request.sampling_params.structured_outputs
        if so is not None and request.structured_output is None:
            if self.structured_output_manager is None:
                raise ValueError("structured outputs are not enabled in this engine")
            request.structured_output = self.structured_output_manager.submit(so)
            request.status = _WAITING_FOR_GRAMMAR
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> None:
        """Abort (or otherwise end) requests from outside the step loop."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == _RUNNING:
                self.running.remove(request)
            elif request.status == _WAITING_FOR_KVS:
                assert self.remote_kv is not None  # only a connector parks requests
                self.remote_kv.drop(request, self.kv_cache_manager)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        kv = self.kv_cache_manager
        if self.connector is not None:
            rid = request.request_id
            computed = kv.req_to_blocks.get(rid, [])[:kv.num_cached_block.get(rid, 0)]
            delay, _ = self.connector.request_finished(request, [b.block_id for b in computed])
            # Conveyor's connectors copy what they keep at the next step's start,
            # before any reuse: blocks are never held past the request.
            assert not delay, "delayed frees are not supported"
        kv.free(request)
        self.encoder.free(request)
        if self.spec is not None:
            self.spec.drop(request.request_id)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting) or (
            self.remote_kv is not None and self.remote_kv.busy())

    def has_requests(self) -> bool:
        """Work for a step: requests, or connector transfers to send the workers."""
        return self.has_unfinished_requests() or (
            self.connector is not None and self.connector.has_pending())

    def reset_prefix_cache(self) -> bool:
        ok = self.kv_cache_manager.reset_prefix_cache()
        if ok and self.connector is not None:
            self.connector.reset(lost_workers=False)
        return ok

    def reset_for_new_workers(self, num_blocks: int) -> None:
        """The worker group was rebuilt: its KV cache and request mirrors are
        gone. Every unfinished request goes back to waiting, in its order
        (running first), to be sent as new and recomputed from its prompt plus
        the tokens it already generated; KV manager and prefix cache start empty."""
        requests = [*self.running, *self.waiting]
        if self.remote_kv is not None:
            requests += self.remote_kv.take_all()
            assert self.connector is not None  # remote_kv exists only with one
            self.connector.reset(lost_workers=True)
        self.running = []
        self.waiting = make_queue(self.policy)
        cc = self.config.cache
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size, self.max_model_len,
                                               cc.enable_prefix_caching)
        self._hook_connector()
        self.encoder = EncoderCacheManager(self.encoder.cache_size, self.encoder.compute_budget)
        self.finished_req_ids = set()
        for r in requests:
            r.num_computed_tokens = r.num_output_placeholders = 0  # in-flight steps died
            if r.status != _WAITING_FOR_GRAMMAR:
                r.status = _WAITING  # NEW for the new workers, outputs included
            self.waiting.add(r)

    # ---- schedule --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(token_budget=self.max_num_batched_tokens, encoder_budget=self.encoder.compute_budget)
        if self.remote_kv is not None:  # parked past the deadline: recompute instead
            for r in reversed(self.remote_kv.expire(self.kv_cache_manager)):
                self.waiting.prepend(r)
        alone = len(self.running) + len(self.waiting) == 1
        self._schedule_running(plan, alone)
        if not plan.preempted:
            self._schedule_waiting(plan, alone)
        out = self._make_output(plan)
        self._update_after_schedule(out)
        return out

    def _chunk(self, num_new: int, alone: bool) -> int:
        t = self.long_prefill_token_threshold
        # A lone request has nobody to share the budget with.
        return t if 0 < t < num_new and not alone else num_new

    def _schedule_running(self, plan: StepPlan, alone: bool) -> None:
        allocate = self.kv_cache_manager.allocate_slots
        running = self.running
        num_scheduled = plan.num_scheduled
        new_block_ids = plan.new_block_ids
        scheduled = plan.running
        chunked = self.long_prefill_token_threshold > 0 and not alone
        budget = plan.token_budget
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            # Drafts and (async) tokens still in flight extend what the request catches up to.
            ph = request.num_output_placeholders
            num_new = len(request.all_token_ids) + ph + len(request.spec_token_ids) - request.num_computed_tokens
            if num_new == 0 or (ph and at_length_cap(request, ph, self.max_model_len)):
                i += 1  # its output is still in flight, or its last token is
                continue
            if chunked:
                num_new = self._chunk(num_new, alone)
            num_new = self.encoder.fit(request, request.num_computed_tokens, min(num_new, budget), plan)
            if num_new == 0:
                i += 1  # an image it reaches does not fit the encoder budget or cache this step
                continue
            new_blocks = allocate(request, num_new)
            while new_blocks is None:
                plan.token_budget = budget
                victim = self._pick_victim()
                if self._preempt(victim, plan) < i:
                    i -= 1  # an already-scheduled request gave its place back
                budget = plan.token_budget
                if victim is request:
                    break
                new_blocks = allocate(request, num_new)
            if new_blocks is None:
                break
            rid = request.request_id
            self.encoder.commit(request, plan)
            scheduled.append(request)
            new_block_ids[rid] = [b.block_id for b in new_blocks] if new_blocks else None
            num_scheduled[rid] = num_new
            if request.spec_token_ids and self.spec is not None:
                drafts = self.spec.scheduled_drafts(request, num_new)
                if drafts:
                    plan.spec_tokens[rid] = drafts
            budget -= num_new
            i += 1
        plan.token_budget = budget

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim: Request, plan: StepPlan) -> int:
        """Preempt by recompute; returns the victim's former index in running."""
        idx = self.running.index(victim) if victim is not self.running[-1] else len(self.running) - 1
        del self.running[idx]
        n = plan.num_scheduled.pop(victim.request_id, None)
        if n is not None:
            plan.token_budget += n
            plan.running.remove(victim)
            plan.new_block_ids.pop(victim.request_id, None)
            plan.spec_tokens.pop(victim.request_id, None)
        victim.spec_token_ids = []  # preemption drops pending drafts
        if self.connector is not None:
            self.connector.request_reset(victim.request_id)
        self.kv_cache_manager.free(victim)
        self.encoder.free(victim)
        plan.encoder_pending.pop(victim.request_id, None)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        plan.preempted.append(victim)
        return idx

    def _schedule_waiting(self, plan: StepPlan, alone: bool) -> None:
        skipped: list[Request] = []
        try:
            self._admit_waiting(plan, alone, skipped)
        finally:
            for r in reversed(skipped):  # back in front, in their order
                self.waiting.prepend(r)

    def _grammar_pending(self, request: Request) -> bool:
        """True while the request's grammar compiles; ends it if compiling failed."""
        sor = request.structured_output
        if not sor.ready():
            return True
        if sor.error is not None:
            self.waiting.pop()
            request.status = RequestStatus.FINISHED_ERROR
            self._error_outputs.append(EngineCoreOutput(
                request.request_id, [], FinishReason.ERROR, error=sor.error))
            self._free_request(request)
            return True
        if request.output_token_ids:  # resubmitted with tokens: the matcher catches up once
            sor.grammar.accept_tokens(request.output_token_ids)
        request.status = _WAITING
        return False

    def _admit_waiting(self, plan: StepPlan, alone: bool, skipped: list[Request]) -> None:
        kv = self.kv_cache_manager
        loras = ({r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
                 if self.max_loras else None)
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.status == _WAITING_FOR_GRAMMAR and self._grammar_pending(request):
                if not request.is_finished():
                    skipped.append(self.waiting.pop())
                continue
            lr = request.lora_request
            if loras is not None and lr is not None and lr.lora_int_id not in loras:
                if len(loras) >= self.max_loras:  # every slot is taken this step: wait
                    skipped.append(self.waiting.pop())
                    continue
                loras.add(lr.lora_int_id)  # may stay unused if KV runs out: conservative
            hit_blocks: list[KVCacheBlock] = []
            num_computed = request.num_computed_tokens
            if num_computed == 0:
                hit_blocks, num_computed = kv.get_computed_blocks(request)
                num_external = self._external_tokens(request, num_computed)
                if num_external:
                    if not self._park(request, hit_blocks, num_computed, num_external):
                        break
                    continue
            num_new = self._chunk(request.num_tokens - num_computed, alone)
            if not self.enable_chunked_prefill and num_new > plan.token_budget:
                break  # no overtaking: later, shorter prompts wait too
            num_new = self.encoder.fit(request, num_computed, min(num_new, plan.token_budget), plan)
            # Back from a KV load num_computed is the request's own already: only a hit's tokens are new.
            if num_new == 0 or kv.allocate_slots(request, num_new, num_computed - request.num_computed_tokens,
                                                 hit_blocks) is None:
                self.encoder.free(request)
                plan.encoder_pending.pop(request.request_id, None)
                if num_new and self.remote_kv is not None and spill_held(self.waiting, kv):
                    continue  # waiting requests' loaded blocks went back to the cache: look again
                break
            self.waiting.pop()
            self.encoder.commit(request, plan)
            self.running.append(request)
            (plan.new if request.status == _WAITING else plan.resumed).append(request)
            plan.new_block_ids[request.request_id] = kv.get_block_ids(request.request_id)
            plan.num_scheduled[request.request_id] = num_new
            plan.token_budget -= num_new
            request.status = _RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                self.kv_reused["local"] += len(hit_blocks) * self.block_size

    def _external_tokens(self, request: Request, num_local: int) -> int:
        """Tokens a connector holds beyond the local hit (0 without one)."""
        if self.connector is None:
            return 0
        return self.connector.get_num_new_matched_tokens(request, num_local)[0]

    def _park(self, request: Request, hit_blocks: list[KVCacheBlock], num_local: int,
              num_external: int) -> bool:
        """Hold blocks for the local hit plus the external tokens and wait in
        WAITING_FOR_REMOTE_KVS for the load; False when the blocks do not fit."""
        kv = self.kv_cache_manager
        # Not hashed yet: nobody may hit blocks whose KV has not arrived.
        if kv.allocate_slots(request, num_external, num_local, hit_blocks, delay_cache=True) is None:
            return False
        assert self.connector is not None and self.remote_kv is not None  # num_external > 0
        self.waiting.pop()
        request.num_computed_tokens = num_local
        self.kv_reused["local"] += num_local
        rid = request.request_id
        load_id = self.connector.update_state_after_alloc(request, kv.get_block_ids(rid), num_external)
        self.remote_kv.park(request, load_id)
        return True

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        meta = self.connector.build_connector_meta() if self.connector is not None else None
        return make_output(plan, OutputExtras(self.max_num_batched_tokens - plan.token_budget,
                                              self.finished_req_ids, self.send_new_token_ids, meta,
                                              self.encoder.take_freed()))

    def get_grammar_bitmask(self, so: SchedulerOutput) -> GrammarOutput | None:
        return grammar_bitmask(so, self.requests, self.structured_output_manager)

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        requests = self.requests
        for rid, n in out.num_scheduled_tokens.items():
            self.prompt_tokens_computed += requests[rid].advance(n)
        self.finished_req_ids = set()
        if self.async_scheduling:
            add_placeholders(requests, out)

    # ---- outputs -------------------------------------------------------------

    def update_from_output(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        sampled = mro.sampled_token_ids
        index = mro.req_id_to_index
        if mro.kv_connector_output is not None and self.connector is not None:
            self._apply_connector_output(mro)
        if mro.expert_tokens:
            add_per_index(self._expert_tokens, mro.expert_tokens)
        num_generated = 0
        for rid in so.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue  # aborted while its step was in flight
            i = index.get(rid, -1)
            new_tokens = sampled[i] if i >= 0 else None
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if drafts and self.spec is not None:
                self.spec.verify(request, drafts, len(new_tokens or ()))
            if mro.prompt_logprobs is not None:
                request.add_prompt_logprobs(mro.prompt_logprobs.get(rid))
            if request.mm_features:
                self.encoder.release_passed(request)
            if not new_tokens:
                continue  # a partial prefill chunk samples nothing
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1  # async: its step's token is known now
            new_tokens, done = self._append_tokens(request, new_tokens)
            if not done and self.spec is not None:
                self.spec.propose(request)
            num_generated += len(new_tokens)
            out = EngineCoreOutput(rid, new_tokens, num_cached_tokens=max(request.num_cached_tokens, 0))
            if mro.logprobs is not None and request.sampling_params.logprobs is not None:
                out.new_logprobs = logprobs_for(mro.logprobs, i, request, len(new_tokens))
            if request.prompt_logprobs is not None:  # the prompt is done: send them once
                out.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            if done:
                out.finish_reason = request.get_finished_reason()
                out.stop_reason = request.stop_reason
                out.stopped_by_grammar = request.stopped_by_grammar
                stopped.append(request)
            outputs.append(out)
        if stopped:
            self._remove_stopped(stopped)
        if self._error_outputs:
            outputs.extend(self._error_outputs)
            self._error_outputs = []
        stats = self.make_stats(so, num_generated) if self.log_stats else None
        return EngineCoreOutputs(outputs, stats, time.monotonic())

    def _apply_connector_output(self, mro: ModelRunnerOutput) -> None:
        assert self.connector is not None and self.remote_kv is not None and mro.kv_connector_output
        results = self.connector.update_connector_output(mro.kv_connector_output)
        for res in results:
            self.kv_reused.update(res.by_source)
        for r in reversed(self.remote_kv.finish_loads(results, self.kv_cache_manager)):
            self.waiting.prepend(r)  # first in line: its blocks are held

    def _append_tokens(self, request: Request, new_tokens: list[int]) -> tuple[list[int], bool]:
        max_len = self.max_model_len
        grammar = request.structured_output.grammar if request.structured_output is not None else None
        for n, tok in enumerate(new_tokens, 1):
            request.output_token_ids.append(tok)
            request.all_token_ids.append(tok)
            if check_stop(request, max_len):
                return new_tokens[:n], True
            if grammar is not None and grammar_done(request, grammar, tok):
                return new_tokens[:n], True
        hasher = self.hasher
        if hasher is not None and len(request.all_token_ids) >= (len(request.block_hashes) + 1) * self.block_size:
            hasher.extend(request)
        return new_tokens, False

    def _remove_stopped(self, stopped: list[Request]) -> None:
        gone = {id(r) for r in stopped}
        running_ids = {id(r) for r in self.running}
        self.running = [r for r in self.running if id(r) not in gone]
        for r in stopped:
            if id(r) not in running_ids:  # preempted while its last step was in flight
                self.waiting.remove(r)
            self._free_request(r)

    def make_stats(self, so: SchedulerOutput | None = None, num_generated: int = 0) -> SchedulerStats:
        pcs = self.kv_cache_manager.make_prefix_cache_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + (len(self.remote_kv.parked) if self.remote_kv else 0),
            kv_cache_usage=self.kv_cache_manager.usage, prefix_cache_stats=pcs,
            num_preemptions=self.num_preemptions, num_generation_tokens=num_generated,
            recovery=self.recovery_stats, moe_routed_tokens=self._take_expert_tokens(),
            encoder_cache_hits=self.encoder.take_hits(), num_prompt_tokens_computed=self.prompt_tokens_computed,
            **kv_stats(self.connector, self.remote_kv, self.kv_reused),
            **(lora_stats(self.max_loras, self.running, self.waiting) if self.max_loras else {}),
            **structured_stats(self.structured_output_manager), **(self.spec.take_stats() if self.spec is not None else {}))

    def _take_expert_tokens(self) -> list[int]:
        taken, self._expert_tokens = self._expert_tokens, []
        return taken
