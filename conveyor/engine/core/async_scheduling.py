"""Async scheduling (vLLM's, PP = 1): the core plans step N+1 while step N
runs on the workers.

The core does not know step N's sampled tokens when it plans N+1, so each
request counts them as output placeholders (`Request.num_output_placeholders`):
the catch-up rule schedules a decode request one more token per token in
flight, and the worker, which sampled those tokens itself and wrote them into
its InputBatch, reads the real ids from there (it executes steps in order, so
step N's tokens are in its batch before step N+1's inputs are built). Nothing
about a token that is not known yet is ever guessed:

- Length caps: a request whose in-flight tokens reach max_tokens or
  max_model_len is not scheduled again (`at_length_cap`).
- EOS / stop ids / stop strings: a request that stops in step N may already be
  in step N+1; that step's token for it is dropped (update_from_output skips a
  request that is gone) and its blocks are freed once, after step N, before
  step N+2 (which runs after N+1 on the workers) can reuse them.
- Preemption: a victim whose step is in flight keeps its placeholder until
  that step's token arrives (update_from_output appends it); it is resumed no
  earlier than the step after, when its tokens are all known.
- Structured outputs and speculative drafts need the latest token on the host
  (the grammar mask for the next token, the drafts after it), so the core
  turns async off per batch (`must_wait`): while a running request is
  structured, or speculation is on, it finishes the step in flight before it
  plans the next. A structured request admitted while another step runs is
  fine: its first mask depends on its prompt only.
- Recovery: in-flight steps die with the worker group; placeholders go back to
  0 and the requests are recomputed from the tokens the core knows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import SchedulerOutput
from conveyor.engine.core.request import Request

if TYPE_CHECKING:
    from conveyor.engine.core.scheduler import Scheduler
    from conveyor.executors.base import Executor


def async_scheduling_mode(cfg: EngineConfig) -> str:
    """scheduler.async_scheduling as one of "auto", "on", "off"."""
    v = cfg.scheduler.async_scheduling
    return ("on" if v else "off") if isinstance(v, bool) else v


def use_async_scheduling(config: EngineConfig, executor: Executor) -> bool:
    """on / off as configured; auto: on where the forward runs on an
    accelerator (executor.overlaps_host_work), off on CPU, where the forward's
    threads hold every core and planning beside them measured slower."""
    if config.parallel.pipeline_parallel_size > 1:
        return False  # the PP batch queue overlaps steps its own way
    mode = async_scheduling_mode(config)
    return mode == "on" or (mode == "auto" and executor.overlaps_host_work)


def at_length_cap(request: Request, placeholders: int, max_model_len: int) -> bool:
    """The tokens in flight already reach max_tokens or max_model_len: the
    request's last token is being sampled, scheduling more would overrun it."""
    return (len(request.output_token_ids) + placeholders >= request.max_tokens
            or len(request.all_token_ids) + placeholders >= max_model_len)


def add_placeholders(requests: dict[str, Request], so: SchedulerOutput) -> None:
    """After schedule(): each request whose computed prefix now covers all its
    tokens, known and in flight, samples one more token in this step."""
    for rid in so.num_scheduled_tokens:
        r = requests[rid]
        if r.num_computed_tokens >= len(r.all_token_ids) + r.num_output_placeholders:
            r.num_output_placeholders += 1


def must_wait(scheduler: Scheduler) -> bool:
    """The next plan depends on a token still in flight beyond what
    placeholders can stand for: the grammar state of a running structured
    request, or the drafts that follow the latest token."""
    if not scheduler.running:
        return False
    if scheduler.spec is not None:
        return True
    return any(r.structured_output is not None for r in scheduler.running)
