"""One schedule() call's plan, and the SchedulerOutput and grammar bitmask made from it."""
from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.contracts import (
    CachedRequestData,
    GrammarOutput,
    LogprobsLists,
    NewRequestData,
    SchedulerOutput,
)
from conveyor.engine.core.request import Request
from conveyor.engine.kv_connector.metadata import KVConnectorMetadata
from conveyor.engine.structured_output.manager import StructuredOutputManager


@dataclass
class StepPlan:
    """What one schedule() call decided, before it becomes a SchedulerOutput."""
    token_budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)
    new: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, list[int] | None] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The encoder stage (conveyor/engine/multimodal/encoder_cache.py): rows the
    # step may still encode, images chosen for requests whose KV is not yet
    # allocated, and the images computed this step per request.
    encoder_budget: int = 0
    encoder_pending: dict[str, list[int]] = field(default_factory=dict)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class OutputExtras:
    """The rest of a SchedulerOutput besides the plan."""
    total_tokens: int
    finished_req_ids: set[str]
    send_new_token_ids: bool  # PP > 1: non-last stages never see sampled tokens
    kv_connector_metadata: KVConnectorMetadata | None = None
    free_encoder_mm_hashes: list[str] = field(default_factory=list)


def make_output(plan: StepPlan, extras: OutputExtras) -> SchedulerOutput:
    new_reqs = []
    for r in plan.new:
        block_ids = plan.new_block_ids[r.request_id]
        assert block_ids is not None  # a new request is sent its whole block list
        new_reqs.append(NewRequestData(r.request_id, r.prompt_token_ids, r.sampling_params, block_ids,
                                       r.num_computed_tokens, r.eos_token_id, list(r.output_token_ids),
                                       r.lora_request, r.mm_features))
    cached = CachedRequestData()
    send_tokens = extras.send_new_token_ids
    for r in (*plan.running, *plan.resumed):
        rid = r.request_id
        cached.req_ids.append(rid)
        cached.new_block_ids.append(plan.new_block_ids[rid])
        cached.num_computed_tokens.append(r.num_computed_tokens)
        if send_tokens:
            c = r.num_computed_tokens
            cached.new_token_ids.append(r.all_token_ids[c:c + plan.num_scheduled[rid]])
    for r in plan.resumed:
        cached.resumed_req_ids.append(r.request_id)
        cached.resumed_token_ids[r.request_id] = list(r.all_token_ids)
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
        num_scheduled_tokens=plan.num_scheduled,
        total_num_scheduled_tokens=extras.total_tokens,
        finished_req_ids=extras.finished_req_ids,
        has_structured_output=_any_structured_sample(plan),
        scheduled_spec_decode_tokens=plan.spec_tokens,
        kv_connector_metadata=extras.kv_connector_metadata,
        scheduled_encoder_inputs=plan.encoder_inputs,
        free_encoder_mm_hashes=extras.free_encoder_mm_hashes)


def _any_structured_sample(plan: StepPlan) -> bool:
    """Before num_computed_tokens advances: does a structured request sample?"""
    n = plan.num_scheduled
    return any(r.structured_output is not None
               and r.num_computed_tokens + n[r.request_id] >= len(r.all_token_ids)
               for r in (*plan.running, *plan.new, *plan.resumed))


def grammar_bitmask(so: SchedulerOutput, requests: dict[str, Request],
                    mgr: StructuredOutputManager | None) -> GrammarOutput | None:
    """The bitmask of the structured requests that sample in `so` (after
    schedule, their computed prefix has caught up with their tokens);
    None when there are none, so unstructured steps pay nothing."""
    if not so.has_structured_output:
        return None
    ids: list[str] = []
    grammars = []
    drafts: list[list[int]] = []  # one mask row per draft position, plus one
    spec_tokens = so.scheduled_spec_decode_tokens
    for rid in so.num_scheduled_tokens:
        r = requests.get(rid)
        if r is None or r.structured_output is None or r.num_computed_tokens < len(r.all_token_ids):
            continue
        ids.append(rid)
        grammars.append(r.structured_output.grammar)
        drafts.append(spec_tokens.get(rid, []))
    assert mgr is not None  # structured requests are admitted only with a manager
    if not any(drafts):
        return GrammarOutput(ids, mgr.bitmask(grammars).tobytes(), mgr.num_words)
    return GrammarOutput(ids, mgr.bitmask(grammars, drafts).tobytes(), mgr.num_words,
                         [len(d) + 1 for d in drafts])


def logprobs_for(lp: LogprobsLists, i: int, request: Request, n: int) -> list[dict[int, float]]:
    k = request.sampling_params.logprobs or 0
    rows = [i] * n if lp.row_start is None else range(lp.row_start[i], lp.row_start[i] + n)
    out = []
    for r in rows:
        ids, vals = lp.token_ids[r], lp.logprobs[r]
        # Column 0 is the sampled token, then the top-k in order.
        d = {ids[j]: vals[j] for j in range(1, min(k + 1, len(ids)))}
        d[ids[0]] = vals[0]
        out.append(d)
    return out
