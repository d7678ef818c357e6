"""Request: the engine core's state for one sequence (never leaves the core)."""
from __future__ import annotations

from typing import Any

import msgspec

from conveyor.engine.contracts import EngineCoreRequest, FinishReason, PromptLogprobs, RequestFields, RequestStatus
from conveyor.engine.kv_connector.metadata import KVTransfer
from conveyor.engine.lora import LoRARequest
from conveyor.engine.multimodal.features import MultiModalFeature
from conveyor.engine.sampling_params import resolved_max_tokens


class Request(RequestFields, kw_only=True, gc=False):
    max_tokens: int = 16  # resolved: never None here
    status: RequestStatus = RequestStatus.WAITING
    # all_token_ids = prompt + outputs; num_computed_tokens counts the prefix
    # whose KV is (or is being) written.
    all_token_ids: list[int] = msgspec.field(default_factory=list)
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    num_computed_tokens: int = 0
    # Chained hashes of the full blocks of all_token_ids, extended as tokens arrive.
    block_hashes: list[bytes] = msgspec.field(default_factory=list)
    num_cached_tokens: int = -1  # prefix-cache hit of the first scheduling
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # StructuredOutputRequest when the output is grammar-constrained.
    structured_output: Any = None
    # Finished because its grammar completed: the last token is text, not a stop token.
    stopped_by_grammar: bool = False
    # Speculative drafts after the last known token (conveyor/engine/spec_decode/scheduling.py).
    spec_token_ids: list[int] = msgspec.field(default_factory=list)
    lora_request: LoRARequest | None = None
    # Async scheduling: tokens sampled by steps still in flight (the worker
    # knows them, the core not yet); the catch-up rule counts them.
    num_output_placeholders: int = 0
    # prompt_logprobs asked for and not yet sent: what the prefill chunks
    # produced so far (positions 1..), sent whole with the first token. While
    # set, the prefix cache is not read (a cached position has no logits).
    prompt_logprobs: PromptLogprobs | None = None
    # Images in prompt order (placeholder ranges sorted, disjoint).
    mm_features: list[MultiModalFeature] = msgspec.field(default_factory=list)
    kv_transfer: KVTransfer | None = None  # EngineCoreRequest's: KV another engine wrote
    kv_lease_s: float = 0.0

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int) -> Request:
        sp = req.sampling_params
        prompt = list(req.prompt_token_ids)
        max_tokens = resolved_max_tokens(sp, len(prompt), max_model_len)
        # A resubmitted request (its engine died) goes on after the tokens it has.
        outputs = list(req.output_token_ids)
        # A resubmitted request with tokens already delivered its prompt logprobs.
        plp = PromptLogprobs(1, [], []) if sp.prompt_logprobs is not None and not outputs else None
        return cls(request_id=req.request_id, prompt_token_ids=prompt, sampling_params=sp,
                   eos_token_id=req.eos_token_id, arrival_time=req.arrival_time,
                   priority=req.priority, cache_salt=req.cache_salt, max_tokens=max_tokens,
                   all_token_ids=prompt + outputs, output_token_ids=outputs,
                   lora_request=req.lora_request,
                   prompt_logprobs=plp, mm_features=list(req.mm_features),
                   kv_transfer=req.kv_transfer, kv_lease_s=req.kv_lease_s)

    def advance(self, n: int) -> int:
        """n more positions are computed (scheduled); how many of them are the prompt's."""
        start = self.num_computed_tokens
        self.num_computed_tokens += n
        return max(0, min(len(self.prompt_token_ids), start + n) - start)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def add_prompt_logprobs(self, chunk: PromptLogprobs | None) -> None:
        """Append a prefill chunk's positions; positions already held (a chunk
        recomputed after preemption or a worker rebuild) are skipped."""
        acc = self.prompt_logprobs
        if chunk is None or acc is None:
            return
        skip = acc.first_pos + len(acc) - chunk.first_pos
        if skip < 0:
            raise RuntimeError(f"request {self.request_id}: prompt logprobs skipped positions "
                               f"{acc.first_pos + len(acc)}..{chunk.first_pos - 1}")
        acc.token_ids.extend(chunk.token_ids[skip:])
        acc.logprobs.extend(chunk.logprobs[skip:])

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)
