"""Messages between the engine core, the executors and the frontends.

Every Struct here may cross a process boundary and is encoded with msgspec
msgpack (never pickle). SchedulerOutput is a diff: new requests travel in full
once, cached requests only as what changed since the worker last saw them.
"""
from __future__ import annotations

import enum

import msgspec
import numpy as np

from conveyor.engine.dp.router.events import KVEvents
from conveyor.engine.kv_connector.metadata import KVConnectorMetadata, KVConnectorOutput, KVTransfer

# SamplingFields, not SamplingParams: decoding a message trusts the checks
# that ran once at the edge (see conveyor/engine/sampling_params.py).
from conveyor.engine.lora import LoRARequest
from conveyor.engine.multimodal.features import MultiModalFeature
from conveyor.engine.sampling_params import SamplingFields


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class RequestStatus(enum.IntEnum):
    # Holding blocks while a KV connector loads its prefix (conveyor/engine/core/remote_kv.py).
    WAITING_FOR_REMOTE_KVS = -2
    # Waiting for its grammar to compile: the scheduler skips it until then.
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = -1
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class RequestFields(msgspec.Struct, kw_only=True, gc=False):
    """What a request is, as the frontend sent it: the fields the wire
    message and the core's own Request share, first and in this order."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingFields
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None


class EngineCoreRequest(RequestFields, kw_only=True, array_like=True, gc=False):
    # Tokens this request already generated and delivered: non-empty only when
    # a frontend resubmits it to a new engine (its EngineCoreActor died). The
    # core recomputes prompt + these and goes on from output position len().
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    # The LoRA adapter this request runs with; None = the base model.
    lora_request: LoRARequest | None = None
    # The session the data-parallel router keeps on one engine (x-session-id /
    # `user`); a single engine ignores it.
    session: str | None = None
    # Images, in prompt order, each with its placeholder range (multimodal/features.py).
    mm_features: list[MultiModalFeature] = msgspec.field(default_factory=list)
    # KV another engine wrote for this request (P/D, a move, a peer pull).
    kv_transfer: KVTransfer | None = None
    # Keep this request's blocks in the shared KV folder this long after it
    # finishes (a prefill leg's lease, for the decode engine to read them).
    kv_lease_s: float = 0.0


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingFields
    block_ids: list[int]
    num_computed_tokens: int
    # The sampler masks it (with stop_token_ids) until min_tokens are out.
    eos_token_id: int | None = None
    # Tokens already generated: non-empty only when a rebuilt worker group
    # relearns a request that was in flight when a rank died.
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeature] = msgspec.field(default_factory=list)


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    req_ids: list[str] = msgspec.field(default_factory=list)
    # Requests that come back after preemption: the worker replaces their
    # block ids and token ids instead of extending them.
    resumed_req_ids: list[str] = msgspec.field(default_factory=list)
    # Tokens scheduled this step, per request; filled only with PP > 1 where
    # non-last stages never see sampled tokens.
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    # None: no new blocks this step.
    new_block_ids: list[list[int] | None] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    # Full token ids (prompt + outputs) of resumed requests.
    resumed_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    # Some request that samples this step is structured: sample_tokens gets a
    # GrammarOutput, and the ranks that sample wait for it.
    has_structured_output: bool = False
    # Speculative decoding: the draft tokens scheduled after each request's
    # last known token (num_scheduled_tokens counts them). The runner computes
    # logits at every draft position plus one and verifies them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # KV connector work for this step's start (conveyor/engine/kv_connector/metadata.py).
    kv_connector_metadata: KVConnectorMetadata | None = None
    # The encoder stage: per request, the indices of its mm_features whose
    # encoder output the workers compute this step (before the forward), and
    # the images whose cached outputs they drop (before computing any).
    scheduled_encoder_inputs: dict[str, list[int]] = msgspec.field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = msgspec.field(default_factory=list)


class GrammarOutput(msgspec.Struct, array_like=True, gc=False):
    """The step's grammar bitmask, rows in the order of structured_output_request_ids.
    Bit j of word w allows token 32*w + j; the mask covers the model's whole vocab.
    A request that verifies k drafts owns k + 1 consecutive rows (num_rows[i]):
    row j is the grammar's mask after its first j drafts. num_rows is None when
    every request has one row."""
    structured_output_request_ids: list[str]
    grammar_bitmask: bytes  # int32 [sum(num_rows) or len(ids), num_words], C order
    num_words: int
    num_rows: list[int] | None = None

    def bitmask(self) -> np.ndarray:
        return np.frombuffer(self.grammar_bitmask, dtype=np.int32).reshape(-1, self.num_words)

    def rows_per_request(self) -> list[int]:
        return self.num_rows if self.num_rows is not None else [1] * len(self.structured_output_request_ids)


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Per sampled row: ids and logprobs of the top-k tokens plus the sampled
    one (index 0 is the sampled token), and the sampled token's rank."""
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_ranks: list[int]
    # None: row i belongs to request i (one token each). Set with speculative
    # decoding: request i's emitted tokens have rows row_start[i], row_start[i]+1, ...
    row_start: list[int] | None = None


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of prompt tokens at positions first_pos, first_pos + 1, ...
    (position 0 never has one). Per position: column 0 is the prompt's own
    token, then the top-k (descending); token_ids and logprobs align."""
    first_pos: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.token_ids)


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False):
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None
    # Requests with prompt_logprobs whose prefill chunk ran this step: the
    # positions that chunk predicts (a chunk of the prompt at a time).
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    # Mixtures of experts: tokens routed to each expert since the last output,
    # summed over the MoE layers of the replying rank's pipeline stage.
    expert_tokens: list[int] | None = None
    # KV connector: loads finished (with the blocks that failed), saves done.
    kv_connector_output: KVConnectorOutput | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput([], {}, [])


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # One {token_id: logprob} dict per new token, when logprobs were asked for.
    new_logprobs: list[dict[int, float]] | None = None
    # The whole prompt's logprobs (positions 1..), with the request's first token.
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # finish_reason STOP because the grammar completed: the last token is output
    # text, not an EOS / stop_token_ids hit whose text is dropped.
    stopped_by_grammar: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class PrefixCacheStats(msgspec.Struct, gc=False):
    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found


class RecoveryStats(msgspec.Struct, gc=False):
    """Worker-group rebuilds since start (cumulative): how many, and a
    histogram of their durations (per bucket of conveyor.engine.core.recovery.RECOVERY_BUCKETS_S,
    not cumulative, the last one +Inf)."""
    restarts: int = 0
    seconds_buckets: list[int] = msgspec.field(default_factory=list)
    seconds_sum: float = 0.0


def add_per_index(acc: list[int], values: list[int]) -> None:
    """acc[i] += values[i], acc grown with zeros to fit (cumulative per-position
    and per-expert counts)."""
    if len(values) > len(acc):
        acc.extend([0] * (len(values) - len(acc)))
    for i, n in enumerate(values):
        acc[i] += n


class SchedulerStats(msgspec.Struct, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    num_preemptions: int = 0  # cumulative
    num_generation_tokens: int = 0  # sampled this step
    # Structured outputs: requests admitted (cumulative), grammar compile times
    # since the last stats (ms), bitmask time and rows this step.
    num_structured_requests: int = 0
    grammar_compile_ms: list[float] = msgspec.field(default_factory=list)
    bitmask_ms: float = 0.0
    bitmask_rows: int = 0
    # Speculative decoding this step: requests that verified drafts, drafts
    # verified, drafts accepted, and accepted drafts per draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    # Mixtures of experts: tokens routed to each expert since the last stats.
    moe_routed_tokens: list[int] = msgspec.field(default_factory=list)
    # Cumulative; None until the first worker-group rebuild (nothing sent before).
    recovery: RecoveryStats | None = None
    # LoRA (vLLM's lora_requests_info): requests per adapter name, running and
    # waiting; max_loras 0 when LoRA is off (then both stay None).
    max_loras: int = 0
    lora_running: dict[str, int] | None = None
    lora_waiting: dict[str, int] | None = None
    # KV reuse since the last stats: prompt tokens not computed, per source
    # ("local" pool, "cpu" / "disk" tiers); tier transfers and failures; blocks
    # held per tier (a gauge). Empty / 0 without a KV connector.
    kv_reused_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    kv_transfer_bytes: int = 0
    kv_transfer_failures: int = 0
    kv_tier_blocks: dict[str, int] = msgspec.field(default_factory=dict)
    # Prompt positions computed (not reused from any cache), cumulative.
    num_prompt_tokens_computed: int = 0
    # Images whose encoder output was found cached (not recomputed) since the last stats.
    encoder_cache_hits: int = 0


class ResumeCall(msgspec.Struct, array_like=True, gc=False):
    """A core client asks its frontend for these requests back (never on the
    wire): their engine was lost, or a data-parallel move takes them to
    another. It travels through the output handler like any output, so the
    frontend reaches it after every output delivered before it; the frontend
    answers CoreClient.resume(tag, requests), each request it still runs
    rebuilt from what it delivered (prompt + output tokens so far, in
    arrival order), and nothing for one it finished or aborted. The delivered
    tokens thus have one record, the frontend's RequestState, and a resumed
    request neither repeats nor skips a token."""
    tag: int  # the client's own, echoed back (which ask this answers)
    request_ids: list[str]


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Set when the engine died: every in-flight request ends with this error.
    engine_error: str | None = None
    # Data parallel: this engine's prefix-cache events and load for the router.
    kv_events: KVEvents | None = None
    # From a core client to its frontend only (contracts.ResumeCall).
    resume: ResumeCall | None = None


class KVCacheInfo(msgspec.Struct, frozen=True, gc=False):
    """Measured at start-up by the workers; the Scheduler is built from it."""
    num_blocks: int  # including the null block 0
    block_size: int
    bytes_per_block: int = 0  # all layers of one rank
    vocab_size: int = 0
    kv_dtype: str = ""  # the KV cache's torch dtype name (a disk tier's model identity)
