"""Responses from engine deltas: one JSON body (`collect`) or SSE chunks
(`sse`), completions and chat, with tool calls. Plain data in, plain data
out: the server hands a Job and its engine streams to the ResponseBuilder it
holds; nothing here calls back into the server.

Invariants:
- Choice index = prompt index * n + the engine's choice index.
- A streamed choice sends its first tokens and its finish at once, other
  tokens once `stream_interval` are pending; one chunk names a choice at
  most once (tool-call deltas spread over successive chunks).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from conveyor.cluster.openai import bodies as B
from conveyor.cluster.openai import errors as E
from conveyor.cluster.openai.job import Job
from conveyor.cluster.openai.metrics import RequestTimer, ServeMetrics
from conveyor.cluster.openai.request_prep import constraint_param
from conveyor.cluster.openai.streams import merge_streams
from conveyor.cluster.openai.tools.response import rounds
from conveyor.engine.frontend.output_processor import CompletionOutput, RequestOutput

Streams = list[AsyncIterator[RequestOutput]]  # one engine stream per prompt of a Job


# One choice accumulated over deltas (CompletionOutput.merge: the engine's one merge).
_Acc = CompletionOutput


class ResponseBuilder:
    """Bodies and chunks of one server. stream_interval: send a streamed
    choice's tokens once this many are pending (its first token and its
    finish always go at once). engine_dead: whether the engine has died (a
    failed delta is then a 503, not a 500)."""

    def __init__(self, fmt: B.LogprobFormatter, metrics: ServeMetrics, model_name: str,
                 stream_interval: int, engine_dead: Callable[[], bool]) -> None:
        self.fmt, self.metrics, self.model_name = fmt, metrics, model_name
        self.stream_interval, self.engine_dead = stream_interval, engine_dead

    def _check_delta(self, reason: str | None, detail: Any = None, req: Any = None) -> None:
        if reason in ("error", "abort"):
            if self.engine_dead():
                raise E.engine_unavailable()
            if isinstance(detail, str) and detail.startswith("structured output grammar"):
                raise E.bad_request(detail, constraint_param(req), "grammar_error")
            raise E.internal_error()

    def _absorb(self, job: Job, batch: list[tuple[int, RequestOutput]], timers: list[RequestTimer],
                into: dict[int, _Acc]) -> int:
        """Fold a batch of deltas into per-choice accumulators; returns new tokens."""
        n_tokens = 0
        for i, ro in batch:
            job.cached[i] = max(job.cached.get(i, 0), ro.num_cached_tokens)
            timers[i].on_tokens(sum(len(d.token_ids) for d in ro.outputs))
            if ro.prompt_logprobs is not None:
                job.prompt_logprobs.setdefault(i, ro.prompt_logprobs)
            for d in ro.outputs:
                self._check_delta(d.finish_reason, d.stop_reason, job.req)
                a = into.setdefault(i * job.n + d.index, _Acc(d.index, "", [], logprobs=[]))
                # max_tokens 0: only the finish counts
                a.merge(_Acc(d.index, "", [], d.finish_reason, d.stop_reason) if job.drop_output else d)
                n_tokens += 0 if job.drop_output else len(d.token_ids)
            if ro.finished:
                timers[i].finish()
        return n_tokens

    async def collect(self, job: Job, streams: Streams) -> dict[str, Any]:
        """The JSON body of a job run to its end."""
        timers = [self.metrics.timer() for _ in job.prompts]
        accs: dict[int, _Acc] = {}
        async for batch in merge_streams(streams):
            self._absorb(job, batch, timers, accs)
        choices = [self._final_choice(job, idx, accs[idx]) for idx in sorted(accs)]
        completion_tokens = sum(len(a.token_ids) for a in accs.values())  # 0 when dropped
        kind = "text_completion" if job.kind == "completion" else "chat.completion"
        return B.envelope(kind, job.rid, self.model_name, choices,
                          B.usage(sum(map(len, job.prompts)), completion_tokens,
                                  sum(job.cached.values())), job.created)

    def _final_choice(self, job: Job, idx: int, a: _Acc) -> dict[str, Any]:
        k = job.k
        if job.kind == "completion":
            text, lp, offset = self._echo_prefix(job, idx)
            if k is not None:
                out = self.fmt.completion(a.token_ids, a.logprobs, k, offset)[0]
                lp = B.join_completion_logprobs(lp, out)
            return B.completion_choice(idx, text + a.text, lp, a.finish_reason, a.stop_reason)
        lp = self.fmt.chat(a.token_ids, a.logprobs, k) if k is not None else None
        choice = B.chat_choice(idx, a.text, lp, a.finish_reason, a.stop_reason)
        return job.tools.finish_choice(choice, a.text) if job.tools else choice

    def _echo_prefix(self, job: Job, idx: int) -> tuple[str, dict[str, Any] | None, int]:
        """(echoed prompt text, its logprobs or None, the text_offset after it)
        for choice idx; nothing without echo."""
        if job.echo is None:
            return "", None, 0
        i = idx // job.n
        text = job.echo[i]
        if job.k is None:
            return text, None, len(text)
        lp, offset = self.fmt.prompt(job.prompts[i], job.prompt_logprobs.get(i), job.k)
        return text, lp, offset

    @staticmethod
    def _echo_ready(job: Job, idx: int, a: _Acc) -> bool:
        """A streamed echo with logprobs waits for its prompt's logprobs (they
        come with child 0's first token; another choice may sample first)."""
        return (job.echo is None or job.k is None or a.finish_reason is not None
                or idx // job.n in job.prompt_logprobs)

    async def sse(self, job: Job, streams: Streams) -> AsyncIterator[bytes]:
        """The job's SSE chunks (without the final [DONE]); an error raises."""
        chat = job.kind == "chat"
        kind = "chat.completion.chunk" if chat else "text_completion"
        timers = [self.metrics.timer() for _ in job.prompts]
        offsets: dict[int, int] = {}
        tokens_out = 0
        if chat:
            for idx in range(job.n * len(job.prompts)):
                yield B.sse(B.envelope(kind, job.rid, self.model_name, [
                    B.chat_delta(idx, {"role": "assistant", "content": ""})], created=job.created))
        pending: dict[int, _Acc] = {}  # choice -> tokens not sent yet
        started: set[int] = set()
        async for batch in merge_streams(streams):
            tokens_out += self._absorb(job, batch, timers, pending)
            ready = sorted(idx for idx, a in pending.items()
                           if (a.finish_reason is not None or idx not in started
                               or len(a.token_ids) >= self.stream_interval)
                           and (idx in started or self._echo_ready(job, idx, a)))
            if ready:
                started.update(ready)
                per_choice = [self._delta_choice(job, idx, pending.pop(idx), offsets) for idx in ready]
                for choices in rounds(per_choice):
                    yield B.sse(B.envelope(kind, job.rid, self.model_name, choices, created=job.created))
        if job.req.include_usage:
            yield B.sse(B.envelope(kind, job.rid, self.model_name, [],
                                   B.usage(sum(map(len, job.prompts)), tokens_out,
                                           sum(job.cached.values())), job.created))

    def _delta_choice(self, job: Job, idx: int, d: _Acc,
                      offsets: dict[int, int]) -> list[dict[str, Any]]:
        """The choice's delta; with tools, the parser may split or hold it."""
        k = job.k
        if job.kind == "completion":
            text, lp = d.text, None
            if idx not in offsets:  # the choice's first chunk carries the echo
                prefix, lp, offsets[idx] = self._echo_prefix(job, idx)
                text = prefix + text
            if k is not None:
                more, offsets[idx] = self.fmt.completion(d.token_ids, d.logprobs, k, offsets[idx])
                lp = B.join_completion_logprobs(lp, more)
            return [B.completion_choice(idx, text, lp, d.finish_reason, d.stop_reason)]
        lp = self.fmt.chat(d.token_ids, d.logprobs, k) if k is not None else None
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        choice = B.chat_delta(idx, delta, lp, d.finish_reason, d.stop_reason)
        return job.tools.delta_choices(idx, choice, d.text) if job.tools else [choice]
