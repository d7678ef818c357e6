"""The data a request handler works on: who asked (RequestMeta), the
validated request ready to run (Job), and a streamed reply (EventStream).
No HTTP types: the HTTP app (app.py, http.py) and batch jobs build and read
these alike."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: batch's parser imports this without loading the engine
    from conveyor.cluster.openai.tools.response import ToolSession
    from conveyor.engine.frontend.prepare import PreparedRequest
    from conveyor.engine.lora import LoRARequest
    from conveyor.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestMeta:
    """What a handler needs besides the body. request_id: as the caller sent
    it (`X-Request-Id`; the server checks it); session: the data-parallel
    affinity key (`X-Session-Id`), None when not sent."""
    request_id: str
    session: str | None = None


@dataclass
class Job:
    """A validated request, ready to run: one engine request per prompt."""
    kind: str  # "completion" | "chat"
    rid: str  # response id; engine ids are rid or rid-p<i>
    engine_ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams]
    req: Any
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolSession | None = None  # chat with tools whose calls may come back
    prepared: list[PreparedRequest] = field(default_factory=list)  # one per prompt
    cached: dict[int, int] = field(default_factory=dict)  # prompt -> its prefix-cache hit
    lora: LoRARequest | None = None  # the adapter `model` named; None = the base model
    # Completions echo: each prompt's text, put before its choices' text (and,
    # with logprobs, its prompt logprobs before theirs).
    echo: list[str] | None = None
    # max_tokens 0: the engine samples one token, which the response drops.
    drop_output: bool = False
    # Per prompt index, once they arrive: the prompt logprobs (echo + logprobs).
    prompt_logprobs: dict[int, list[dict[int, float] | None]] = field(default_factory=dict)
    # Chat image_url parts, loaded (one prompt): sent with it as multi_modal_data.
    images: list[Any] = field(default_factory=list)

    @property
    def n(self) -> int:
        return self.params[0].n

    @property
    def cost(self) -> int:
        """Engine requests this job runs: what admission counts."""
        return len(self.prompts) * self.n

    @property
    def k(self) -> int | None:
        return self.params[0].logprobs


@dataclass
class EventStream:
    """A streamed reply: its SSE chunks (errors in band, then [DONE]), and
    `release`, which whoever sends the chunks calls exactly once when the
    stream is over, however it ends (it gives back the admission slots)."""
    chunks: AsyncIterator[bytes]
    release: Callable[[], None]


# What a handler returns: a JSON body (dict) or a stream of SSE chunks.
Reply = dict[str, Any] | EventStream
