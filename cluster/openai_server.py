"""The OpenAI-compatible HTTP app of one replica: FastAPI routes over one AsyncLLM.

Independent of Ray Serve (cluster/serve_app.py wraps it in a deployment), so
it can be driven in-process through an ASGI transport.

Invariants:
- Validation (JSON, fields, model name, tokenization, context length, the
  engine's own prepare()) finishes for every prompt before any is queued.
- Every engine stream is closed when its HTTP request ends for any reason
  (finish, error, client disconnect -> task cancellation), which aborts the
  request in the engine exactly once (AsyncLLM guarantees the "once").
- One request id: the `X-Request-Id` header (Serve's proxy sets one when the
  client did not and echoes it back) -> the engine request id and the
  response `id` (`cmpl-<id>` / `chatcmpl-<id>`).
- Prompts are never logged.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster import lora_routes
from cluster import openai_protocol as P
from cluster import request_prep as RP
from cluster.metrics import CONTENT_TYPE, ServeMetrics
from cluster.openai_responses import ResponseBuilding
from cluster.tool_response import ToolSession
from cluster.tools import ToolPlan, template_input, tool_plan
from engine.async_client import AsyncLLM
from engine.config import EngineConfig
from engine.errors import EngineDeadError, UnsendableRequestError
from engine.frontend import ContextLengthError, PreparedRequest
from engine.lora import LoRARequest
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import DEFAULT_CHAT_TEMPLATE

log = logging.getLogger("conveyor.serve")

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
RETRY_AFTER_S = 1
HEALTH_TTL_S = 1.0


def model_name_of(config: EngineConfig) -> str:
    return config.serve.served_model_name or os.path.basename(config.model.path.rstrip("/")) or "model"


def engine_unavailable(message: str = "the engine is not available") -> P.APIError:
    return P.APIError(503, message, type="service_unavailable_error", code="engine_unavailable",
                      headers={"Retry-After": "5"})


def at_capacity(limit: int) -> P.APIError:
    return P.APIError(429, f"The server is at capacity ({limit} requests in flight); retry later.",
                      type="rate_limit_error", code="server_at_capacity",
                      headers={"Retry-After": str(RETRY_AFTER_S)})


def too_many_sequences(cost: int, limit: int) -> P.APIError:
    return P.bad_request(f"this request asks for {cost} sequences (prompts x n); the server runs "
                         f"at most {limit} at once", "prompt", "too_many_sequences")


def internal_error() -> P.APIError:
    return P.APIError(500, "internal server error", type="internal_error", code="internal_error")


@dataclass
class _Job:
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


class OpenAIServer(ResponseBuilding):
    def __init__(self, llm: AsyncLLM, config: EngineConfig, metrics: ServeMetrics | None = None,
                 max_admitted: int | None = None) -> None:
        """max_admitted: engine requests (prompts x n) in flight at once (None:
        no limit); beyond it a validated request gets 429 + Retry-After, and
        one that alone asks for more gets 400."""
        # serve.stream_interval: send a choice's tokens once this many are
        # pending (the first token and the finish always go at once).
        self.llm, self.config, self.stream_interval = llm, config, config.serve.stream_interval
        self.max_admitted, self.admitted = max_admitted, 0
        self._health: asyncio.Future[str] | None = None
        self._health_at = 0.0
        self.model_name = model_name_of(config)
        self.metrics = metrics or ServeMetrics(llm, self.model_name)
        self.fmt = P.LogprobFormatter(llm.tokenizer)
        self.draining = False
        # Heavy jobs (RP.off_loop); not the default executor, which health checks use.
        self.prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="conveyor-prep")
        self.response_store: Any = None  # /v1/responses' (None: in-process, cluster/responses_api.py)

    async def start(self) -> None:
        """Start the engine's output pump on the loop that serves requests.
        AsyncLLM starts lazily on the first generate(); until then its health
        check fails, which would make Serve kill a fresh replica."""
        self.llm.start()

    # ---- validation ---------------------------------------------------------------

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names ("<adapter>" or "<base>:<adapter>"),
        None for the base model; 404 for anything else."""
        if model is None or model == self.model_name:
            return None
        loras = self.llm.frontend.loras
        try:
            if loras is not None:
                return loras.resolve(model, self.model_name)
        except KeyError:
            pass
        raise P.APIError(404, f"The model `{model}` does not exist.", code="model_not_found",
                         param="model")

    def _check_alive(self) -> None:
        if self.draining:
            raise engine_unavailable("the server is shutting down")
        if self.llm.dead_error is not None:
            raise engine_unavailable()

    def _tokenize(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if self.llm.tokenizer is None:
            raise P.bad_request("this model has no tokenizer: send token ids", param)
        return RP.tokenize_bounded(self.llm.tokenizer, text, add_special_tokens, param,
                                   self.config.max_model_len)

    def _check_cost(self, cost: int) -> None:
        """A request that could never be admitted fails before any work."""
        if self.max_admitted is not None and cost > self.max_admitted:
            raise too_many_sequences(cost, self.max_admitted)

    def _check_priority(self, req: Any) -> None:
        if req.priority != 0 and not self.config.serve.allow_client_priority:
            raise P.bad_request("priority is not accepted from clients on this server "
                                "(serve.allow_client_priority is false)", "priority",
                                "unsupported_parameter")

    @staticmethod
    def _prompt_items(prompt: Any) -> list[Any]:
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [prompt]
        return list(prompt)

    def _completion_prompts(self, prompt: Any, n: int) -> list[list[int]]:
        items = self._prompt_items(prompt)
        if not items or any(isinstance(p, str) and not p for p in items):
            raise P.bad_request("prompt must not be empty", "prompt")
        self._check_cost(len(items) * n)  # before tokenizing thousands of prompts
        out = [self._tokenize(p, True, "prompt") if isinstance(p, str) else list(p) for p in items]
        if any(not ids for ids in out):
            raise P.bad_request("prompt must not be empty", "prompt")
        return out

    def _chat_prompt(self, req: P.ChatRequest) -> list[int]:
        tok = self.llm.tokenizer
        if tok is None:
            raise P.bad_request("this model has no tokenizer: chat is unavailable", "messages")
        try:
            messages, extra = template_input(req, tok.chat_template or DEFAULT_CHAT_TEMPLATE)
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                           **extra)
        except ValueError as e:
            raise P.bad_request(str(e), "messages") from None
        # The template already holds the special tokens it wants (vLLM's default).
        ids = self._tokenize(text, False, "messages")
        if not ids:
            raise P.bad_request("the rendered chat prompt is empty", "messages")
        return ids

    def _params(self, req: Any, requested: int | None, plan: ToolPlan | None = None) -> SamplingParams:
        """The request's SamplingParams, built (so checked) once, before any
        prompt is tokenized; max_tokens None fills the context (resolved per
        prompt by the engine's frontend, which also checks the context length)."""
        self._check_priority(req)
        sp = P.to_sampling_params(req, requested)
        if plan is not None and plan.constraint is not None:  # "required"/named tool_choice
            sp = sp.clone(structured_outputs=plan.constraint)
        if sp.structured_outputs is not None:
            self._check_structured(req, sp)
        return sp

    def _check_structured(self, req: Any, sp: SamplingParams) -> None:
        """Compile-check the constraint once, here, so a bad one is a 400 naming
        the field the client used (the engine's own check then hits a cache)."""
        from cluster.structured_request import constraint_field

        param = constraint_field(req.structured_outputs)
        try:
            self.llm.frontend.validate_structured_outputs(sp.structured_outputs)
        except ValueError as e:
            raise P.bad_request(str(e), param) from None

    def _prepare(self, job: _Job, prompt_param: str) -> None:
        """The engine's own checks, once per prompt (context length, vocab
        range, n cap, duplicate ids); queues nothing. Never truncates: an
        over-long request is a 400 context_length_exceeded."""
        self._check_alive()
        for eid, ids, sp in zip(job.engine_ids, job.prompts, job.params):
            try:
                job.prepared.append(self.llm.prepare(ids, sp, eid, job.req.priority,
                                                     lora_request=job.lora))
            except EngineDeadError:
                raise engine_unavailable() from None
            except ContextLengthError as e:
                total = e.prompt_len + e.max_tokens
                raise P.bad_request(
                    f"This model's maximum context length is {e.max_model_len} tokens. However, you "
                    f"requested {total} tokens ({e.prompt_len} in the prompt, {e.max_tokens} for the "
                    f"completion). Reduce the prompt or the completion length.",
                    prompt_param, "context_length_exceeded") from None
            except ValueError as e:
                msg = str(e)
                field_ = msg.split(" ", 1)[0]
                param = field_ if field_ in SamplingParams.__struct_fields__ else prompt_param
                raise P.bad_request(msg, param) from None

    @staticmethod
    def _request_id(request: Request) -> str:
        rid = request.headers.get("x-request-id", "")
        if not _REQUEST_ID_RE.match(rid):
            raise P.bad_request("X-Request-Id must be 1-128 characters of [A-Za-z0-9._:-]",
                                "X-Request-Id")
        return rid

    def _job(self, kind: str, request: Request, req: Any, prompts: list[list[int]],
             sp: SamplingParams, prompt_param: str, plan: ToolPlan | None = None,
             lora: LoRARequest | None = None) -> _Job:
        self._check_cost(len(prompts) * sp.n)
        params = [sp] * len(prompts)
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{self._request_id(request)}"
        eids = [rid] if len(prompts) == 1 else [f"{rid}-p{i}" for i in range(len(prompts))]
        job = _Job(kind, rid, eids, prompts, params, req, tools=plan and ToolSession(plan), lora=lora)
        self._prepare(job, prompt_param)
        # Data parallel: a soft preference for the engine this session used last.
        session = request.headers.get("x-session-id") or getattr(req, "user", None)
        for prep in job.prepared:
            prep.session = session[:256] if session else None
        return job

    # ---- endpoints ---------------------------------------------------------------

    async def completions(self, req: P.CompletionRequest, request: Request) -> Response:
        """req: validated by FastAPI (the route's body model) or validate_model."""
        job = await RP.off_loop(self.prep_pool, self._completion_job, req, request)
        return await self._respond(job)

    def _decode(self, ids: list[int]) -> str:
        tok = self.llm.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""

    async def chat(self, req: P.ChatRequest, request: Request) -> Response:
        return await self._respond(await RP.off_loop(self.prep_pool, self.chat_job, req, request))

    def _completion_job(self, req: P.CompletionRequest, request: Request) -> _Job:  # sync: any thread
        P.check_unsupported(req)
        lora = self._check_model(req.model)
        # max_tokens 0 with echo (score the prompt only): one token is sampled
        # and dropped. Without echo, 0 stays an error (nothing to return).
        prompt_only = req.max_tokens == 0 and req.echo
        sp = self._params(req, 1 if prompt_only else req.max_tokens)
        if req.echo and req.logprobs is not None:
            sp = sp.clone(prompt_logprobs=req.logprobs)
        prompts = self._completion_prompts(req.prompt, sp.n)
        job = self._job("completion", request, req, prompts, sp, "prompt", lora=lora)
        job.drop_output = prompt_only
        if req.echo:
            job.echo = [p if isinstance(p, str) else self._decode(ids)
                        for p, ids in zip(self._prompt_items(req.prompt), prompts)]
        return job

    def chat_job(self, req: P.ChatRequest, request: Request) -> _Job:  # sync: any thread
        """A validated chat request, ready to run (also /v1/responses' path)."""
        P.check_unsupported(req)
        lora = self._check_model(req.model)
        plan = tool_plan(req, self.config.serve.tool_call_parser,
                         self.llm.frontend.validate_structured_outputs,
                         self.config.structured_outputs.allow_additional_properties)
        sp = self._params(req, P.chat_max_tokens(req)[0], plan)
        return self._job("chat", request, req, [self._chat_prompt(req)], sp, "messages", plan, lora)

    def models(self) -> dict[str, Any]:
        data = [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "conveyor",
                 "max_model_len": self.config.max_model_len}]
        data += lora_routes.adapter_models(self.llm.frontend.loras, self.model_name,
                                           self.config.max_model_len)
        return {"object": "list", "data": data}

    async def health(self) -> Response:
        if self.draining:
            return error_response(engine_unavailable("the server is shutting down"))
        try:
            status = await self.check_engine()
        except Exception as e:  # noqa: BLE001 - any failure means unhealthy
            log.warning("health check failed: %s", e)
            return error_response(engine_unavailable())
        # 200 while a lost worker group is rebuilt: Serve must not replace us.
        return JSONResponse({"status": status})

    async def check_engine(self) -> str:
        """"ok" | "recovering", or raise if the engine is unhealthy. The check
        is a Ray round trip when the engine is an actor, so it runs off the
        event loop; concurrent callers share one check, and its result stands
        for HEALTH_TTL_S."""
        if self.llm.dead_error is not None:  # known locally: never hidden by a cached pass
            raise EngineDeadError(self.llm.dead_error)
        now = time.monotonic()
        if self._health is None or (self._health.done() and now - self._health_at > HEALTH_TTL_S):
            self._health = asyncio.get_running_loop().run_in_executor(None, self.llm.check_health)
            self._health_at = now
        return await asyncio.shield(self._health) or "ok"

    def metrics_response(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ---- running -------------------------------------------------------------------

    def _streams(self, job: _Job) -> list[AsyncIterator[RequestOutput]]:
        interval = self.config.serve.stream_batching_interval_ms / 1000.0 if job.req.stream else 0.0
        return [self.llm.generate(prep.prompt_token_ids, sp, min_interval_s=interval, prepared=prep)
                for prep, sp in zip(job.prepared, job.params)]

    def _admit(self, job: _Job) -> None:
        """Take the job's engine ids (AsyncLLM.reserve_ids: the one check that
        they are not in flight) and its slots (one per engine request: prompts x n)."""
        try:
            self.llm.reserve_ids(job.engine_ids)
        except ValueError as e:
            raise P.bad_request(str(e), "X-Request-Id") from None
        if self.max_admitted is not None and self.admitted + job.cost > self.max_admitted:
            self.llm.release_ids(job.engine_ids)
            raise at_capacity(self.max_admitted)
        self.admitted += job.cost
        self.metrics.in_progress.inc()

    def _release(self, job: _Job) -> None:
        self.admitted -= job.cost
        self.llm.release_ids(job.engine_ids)
        self.metrics.in_progress.dec()

    async def _respond(self, job: _Job) -> Response:
        if job.req.stream:
            return self.event_stream(job, self._guarded_sse(job))
        return JSONResponse(await self.collect(job))

    async def collect(self, job: _Job) -> dict[str, Any]:
        """Run a non-streamed job to its JSON body, holding its admission slots."""
        self._admit(job)
        try:
            return await self._collect(job)
        finally:
            self._release(job)
            await self._abort_all(job)

    def event_stream(self, job: _Job, body: AsyncIterator[bytes]) -> Response:
        """Admit the job and stream `body` (built over `_guarded_sse(job)`)."""
        self._admit(job)
        return _ReleasingStream(body, lambda: self._release(job), media_type="text/event-stream",
                                headers=_SSE_HEADERS)

    async def _abort_all(self, job: _Job) -> None:
        # No-op for finished requests; makes a cancelled handler's abort explicit.
        for eid in job.engine_ids:
            await self.llm.abort(eid)

    def _check_delta(self, reason: str | None, detail: Any = None, req: Any = None) -> None:
        if reason in ("error", "abort"):
            if self.llm.dead_error is not None:
                raise engine_unavailable()
            if isinstance(detail, str) and detail.startswith("structured output grammar"):
                raise P.bad_request(detail, RP.constraint_param(req), "grammar_error")
            raise internal_error()

    async def _guarded_sse(self, job: _Job) -> AsyncIterator[bytes]:
        """SSE body: errors after the stream started go in-band, then [DONE].
        Cancellation (client gone) propagates and closes the engine streams."""
        try:
            async for chunk in self._sse(job):
                yield chunk
        except P.APIError as e:
            yield P.sse(e.body())
        except EngineDeadError:
            yield P.sse(engine_unavailable().body())
        except UnsendableRequestError as e:
            yield P.sse(P.bad_request(str(e)).body())
        except Exception:
            log.exception("stream %s failed", job.rid)
            yield P.sse(internal_error().body())
        finally:
            await self._abort_all(job)
        yield P.SSE_DONE

# ---- the ASGI app ----------------------------------------------------------------------

class _ReleasingStream(StreamingResponse):
    """A streaming response that calls `release` once it is over, however it
    ends (finished, failed, client gone): an admission slot is never leaked."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._release_slot = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release_slot()


def error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
