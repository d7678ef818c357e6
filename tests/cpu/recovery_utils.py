"""What the recovery tests share: the greedy + seeded request mix, its tokens
from an undisturbed run, and draining streams that a lost rank, engine actor
or node interrupts (to their end, or to "error" past the restart budget)."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Collection
from typing import Any

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.frontend.async_client import EngineDeadError as FrontendDeadError

Drained = tuple[list[int], str | None]  # a stream's tokens and its last finish reason


def greedy_and_seeded(n: int, max_tokens: int, temperature: float, seed: int) -> list[SamplingParams]:
    """n // 2 greedy requests, then seeded ones at `temperature` (seeds seed,
    seed + 1, ...), EOS ignored: the mix whose tokens a recovery must not change."""
    half = n // 2
    return ([SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * half
            + [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i, ignore_eos=True)
               for i in range(n - half)])


def undisturbed_tokens(ckpt: str, prompts: list[list[int]], params: list[SamplingParams],
                       **llm_kwargs) -> list[list[int]]:
    """Token ids of an in-process run that nothing disturbs (the reference)."""
    llm = LLM(model=ckpt, **llm_kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def before_step(llm, at: int | Collection[int], act: Callable[[], None]) -> Callable[[], None]:
    """Run act() before the engine's step number `at` (or each of them; the
    first step is 0). Returns what puts the engine's own step back."""
    core, orig, calls = llm.engine, llm.engine.step_fn, itertools.count()
    steps = {at} if isinstance(at, int) else set(at)

    def step():
        if next(calls) in steps:
            act()
        return orig()
    core.step_fn = step
    return lambda: setattr(core, "step_fn", orig)


async def drain(first, stream) -> Drained:
    """A stream's tokens from its first output on, and its last finish reason."""
    tokens, reason = list(first.outputs[0].token_ids), first.outputs[0].finish_reason
    async for out in stream:
        tokens += out.outputs[0].token_ids
        reason = out.outputs[0].finish_reason
    return tokens, reason


async def drain_all(firsts: list, streams: list, timeout_s: float) -> list[Drained]:
    """drain() every stream. A bound, not a measurement: a stream must end, not hang."""
    return await asyncio.wait_for(asyncio.gather(*(drain(f, s) for f, s in zip(firsts, streams))), timeout_s)


async def expect_fail_fast(llm, firsts: list, streams: list, max_tokens: int,
                           timeout_s: float = 30.0) -> list[Drained]:
    """Past the restart budget: every in-flight stream ends "error" within
    timeout_s, short of max_tokens; then the engine fails its health check and
    refuses new requests."""
    outs = await drain_all(firsts, streams, timeout_s)
    assert [r for _, r in outs] == ["error"] * len(outs), [r for _, r in outs]
    assert all(len(t) < max_tokens for t, _ in outs)
    with pytest.raises(FrontendDeadError):
        llm.check_health()
    with pytest.raises(FrontendDeadError):
        llm.prepare([1, 2, 3], SamplingParams(max_tokens=2))  # new requests refused
    return outs


class FakeFrontend:
    """The frontend's part for a core client without a frontend: an output
    handler that records what was delivered and each request's delivered
    tokens, and answers the client's ResumeCalls, in order, when answer()
    is called (a real frontend answers on its own thread, never inside the
    handler: the client may hold its lock there)."""

    def __init__(self) -> None:
        self.got: list = []  # every message delivered, in order
        self.asks: list = []  # ResumeCalls not answered yet
        self.requests: dict = {}
        self.tokens: dict[str, list[int]] = {}
        self.done: set[str] = set()

    def __call__(self, outs) -> None:
        self.got.append(outs)
        for o in outs.outputs:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.done.add(o.request_id)
        if outs.resume is not None:
            self.asks.append(outs.resume)

    def add(self, client, request) -> None:
        self.requests[request.request_id] = request
        client.add_request(request)

    def answer(self, client) -> int:
        """Answer every ask so far; returns how many requests went back."""
        import msgspec

        asks, self.asks, n = self.asks, [], 0
        for call in asks:
            back = [msgspec.structs.replace(self.requests[rid], output_token_ids=list(self.tokens.get(rid, [])))
                    for rid in call.request_ids if rid in self.requests and rid not in self.done]
            client.resume(call.tag, back)
            n += len(back)
        return n

    def answering(self, client, call: Callable[[], Any]) -> tuple[Any, int]:
        """call() on its own thread while this one answers the client's asks
        until it returns, as a real frontend does; (its result, requests sent back)."""
        import threading

        out: list = []

        def run() -> None:
            try:
                out.append((True, call()))
            except BaseException as e:  # raised again on the caller's thread
                out.append((False, e))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        n = 0
        while t.is_alive():
            n += self.answer(client)
            t.join(0.01)
        ok, value = out[0]
        if not ok:
            raise value
        return value, n + self.answer(client)
