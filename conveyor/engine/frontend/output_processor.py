"""Frontend side of a request: token ids, incremental text, stop strings,
logprobs and the finish reason, built from EngineCoreOutputs.

Shared by LLM (offline) and the async client (serving). A stop string is
detected here, not in the core: the caller must then abort the request in the
core (process() returns True)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from conveyor.engine.contracts import EngineCoreOutput, EngineCoreRequest, FinishReason, PromptLogprobs, ResumeCall
from conveyor.engine.frontend.detokenizer import IncrementalDetokenizer
from conveyor.engine.frontend.tokenizer import Tokenizer
from conveyor.engine.sampling_params import SamplingFields


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, delta: CompletionOutput) -> None:
        """Fold the next delta of the same choice into this one: text and token
        ids concatenated, logprobs appended, the finish taken from the delta.
        The one merge of deltas (AsyncLLM's slot, collect(), the server's
        per-choice accumulators); `self` must own its lists."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    # SamplingParams.prompt_logprobs=k: one entry per prompt token, None for
    # the first, then {token_id: logprob} with the top-k and the prompt token.
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class RequestState:
    """One engine request (one of the n children of a user request).

    The one record of the tokens delivered to the user for it: a core client
    that must resubmit the request (a lost engine, a data-parallel move) asks
    for it through the outputs (ResumeCall) and gets resumed(), built here,
    on the thread that delivers, after every output delivered before."""
    request_id: str
    index: int
    sampling_params: SamplingFields
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The prefix-cache hit of the request's first output, kept: a request
    # resumed on another engine (recovery, migration) reports it throughout,
    # so usage stays what the client was first told.
    first_cache_hit: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # What was sent to the core (no output tokens): resumed() starts from it.
    request: EngineCoreRequest | None = None

    @classmethod
    def make(cls, request_id: str, index: int, sp: SamplingFields, prompt_token_ids: list[int],
             tokenizer: Tokenizer | None, request: EngineCoreRequest | None = None) -> RequestState:
        detok = None
        if tokenizer is not None:
            detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, sp.skip_special_tokens,
                                           list(sp.stop), sp.include_stop_str_in_output,
                                           min_tokens=sp.min_tokens)
        return cls(request_id, index, sp, detok, logprobs=[] if sp.logprobs is not None else None,
                   request=request)

    def resumed(self) -> EngineCoreRequest | None:
        """The request to resubmit: as first sent, with every token delivered
        so far as its output tokens (the new engine goes on at the next output
        position, so seeded draws, max_tokens and penalties continue). None
        once it finished (or when it was never sent)."""
        if self.finished or self.request is None:
            return None
        return msgspec.structs.replace(self.request, output_token_ids=list(self.token_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_cached_tokens(self) -> int:
        return self.first_cache_hit or 0

    def process(self, o: EngineCoreOutput) -> bool:
        """Absorb one step's output; True if a stop string ended the request
        here and the core must abort it."""
        if self.finished:
            return False
        if self.first_token_time is None and o.new_token_ids:
            self.first_token_time = time.monotonic()
        self.token_ids.extend(o.new_token_ids)
        if self.first_cache_hit is None:
            self.first_cache_hit = o.num_cached_tokens
        if self.logprobs is not None and o.new_logprobs:
            self.logprobs.extend(o.new_logprobs)
        if o.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprob_dicts(o.prompt_logprobs,
                                                        self.sampling_params.prompt_logprobs or 0)
        stop_str = None
        if self.detokenizer is not None:
            stop_str = self.detokenizer.update(
                o.new_token_ids,
                stop_terminated=o.finish_reason == FinishReason.STOP and not o.stopped_by_grammar)
        if stop_str is not None:
            self.finish_reason, self.stop_reason = "stop", stop_str
            return not o.finished
        if o.finished:
            self.finish_reason, self.stop_reason = str(o.finish_reason), o.stop_reason
            if o.error:
                self.stop_reason = o.error
            if self.detokenizer is not None:
                self.detokenizer.finish()
        return False

    def fail(self, reason: str, message: str | None = None) -> None:
        if not self.finished:
            self.finish_reason, self.stop_reason = reason, message

    @property
    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def completion(self) -> CompletionOutput:
        cum = None
        if self.logprobs:
            cum = sum(d.get(t, 0.0) for d, t in zip(self.logprobs, self.token_ids))
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.finish_reason,
                                self.stop_reason, self.logprobs, cum)


def resumed_requests(call: ResumeCall, state_of: Callable[[str], RequestState | None]
                     ) -> list[EngineCoreRequest]:
    """A frontend's answer to `call`: each asked request it still runs, resumed."""
    out = []
    for rid in call.request_ids:
        st = state_of(rid)
        r = st.resumed() if st is not None else None
        if r is not None:
            out.append(r)
    return out


def prompt_logprob_dicts(plp: PromptLogprobs, k: int) -> list[dict[int, float] | None]:
    """vLLM's shape: None for position 0, then per position the top-k and the
    prompt token (k + 1 entries when the prompt token is not in the top-k)."""
    out: list[dict[int, float] | None] = [None] * plp.first_pos
    for ids, vals in zip(plp.token_ids, plp.logprobs):
        d = {ids[j]: vals[j] for j in range(1, min(k + 1, len(ids)))}
        d[ids[0]] = vals[0]
        out.append(d)
    return out
