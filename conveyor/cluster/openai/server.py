"""The OpenAI request handling of one replica over one AsyncLLM: validate ->
admit -> run. Data in (a parsed request model and its RequestMeta), data out
(a JSON body or an EventStream): the HTTP app (app.py) and batch jobs
(conveyor/cluster/batch/engines.py) call the same methods.

Invariants:
- Validation (JSON, fields, model name, tokenization, context length, the
  engine's own prepare()) finishes for every prompt before any is queued.
- Every engine stream is closed when its HTTP request ends for any reason
  (finish, error, client disconnect -> task cancellation), which aborts the
  request in the engine exactly once (AsyncLLM guarantees the "once").
- One request id: RequestMeta.request_id (over HTTP the `X-Request-Id`
  header, which Serve's proxy sets when the client did not and echoes back)
  -> the engine request id and the response `id` (`cmpl-<id>` / `chatcmpl-<id>`).
- Prompts are never logged.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from conveyor.cluster.openai import bodies as B
from conveyor.cluster.openai import errors as E
from conveyor.cluster.openai import protocol as P
from conveyor.cluster.openai import request_prep as RP
from conveyor.cluster.openai.images import split_images
from conveyor.cluster.openai.job import EventStream, Job, Reply, RequestMeta
from conveyor.cluster.openai.metrics import ServeMetrics
from conveyor.cluster.openai.responses import ResponseBuilder
from conveyor.cluster.openai.structured_request import constraint_field
from conveyor.cluster.openai.tools.request import ToolPlan, template_input, tool_plan
from conveyor.cluster.openai.tools.response import ToolSession
from conveyor.engine.config import EngineConfig
from conveyor.engine.errors import EngineDeadError, ParamError, UnsendableRequestError
from conveyor.engine.frontend.async_client import AsyncLLM
from conveyor.engine.frontend.output_processor import RequestOutput
from conveyor.engine.frontend.prepare import ContextLengthError
from conveyor.engine.frontend.tokenizer import DEFAULT_CHAT_TEMPLATE
from conveyor.engine.lora import LoRARequest
from conveyor.engine.multimodal.chat import media_policy
from conveyor.engine.sampling_params import SamplingParams

log = logging.getLogger("conveyor.serve")

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
HEALTH_TTL_S = 1.0


def model_name_of(config: EngineConfig) -> str:
    return config.serve.served_model_name or os.path.basename(config.model.path.rstrip("/")) or "model"


def adapter_models(loras: Any, base_name: str, max_model_len: int) -> list[dict[str, Any]]:
    if loras is None:
        return []
    return [{"id": name, "object": "model", "created": 0, "owned_by": "conveyor",
             "root": lr.lora_path, "parent": base_name, "max_model_len": max_model_len}
            for name, lr in loras.by_name.items()]


class OpenAIServer:
    def __init__(self, llm: AsyncLLM, config: EngineConfig, metrics: ServeMetrics | None = None,
                 max_admitted: int | None = None) -> None:
        """max_admitted: engine requests (prompts x n) in flight at once (None:
        no limit); beyond it a validated request gets 429 + Retry-After, and
        one that alone asks for more gets 400."""
        self.llm, self.config = llm, config
        self.max_admitted, self.admitted = max_admitted, 0
        self._health: asyncio.Future[str] | None = None
        self._health_at = 0.0
        self.model_name = model_name_of(config)
        self.metrics = metrics or ServeMetrics(llm, self.model_name)
        self.fmt = B.LogprobFormatter(llm.tokenizer)
        self.builder = ResponseBuilder(self.fmt, self.metrics, self.model_name,
                                       config.serve.stream_interval, lambda: llm.dead_error is not None)
        self.draining = False
        # Heavy jobs (RP.off_loop); not the default executor, which health checks use.
        self.prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="conveyor-prep")
        self.response_store: Any = None  # /v1/responses' (None: in-process, conveyor/cluster/openai/responses_api/routes.py)

    async def start(self) -> None:
        """Start the engine's output pump on the loop that serves requests.
        AsyncLLM starts lazily on the first generate(); until then its health
        check fails, which would make Serve kill a fresh replica."""
        self.llm.start()
        if self.llm.frontend.images is not None:  # load the image processor before the first image asks
            self.prep_pool.submit(self.llm.frontend.images.processor)

    # ---- validation ---------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
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
        raise E.APIError(404, f"The model `{model}` does not exist.", code="model_not_found",
                         param="model")

    def _check_alive(self) -> None:
        if self.draining:
            raise E.engine_unavailable("the server is shutting down")
        if self.llm.dead_error is not None:
            raise E.engine_unavailable()

    def tokenize(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if self.llm.tokenizer is None:
            raise E.bad_request("this model has no tokenizer: send token ids", param)
        return RP.tokenize_bounded(self.llm.tokenizer, text, add_special_tokens, param,
                                   self.config.max_model_len)

    def _check_cost(self, cost: int) -> None:
        """A request that could never be admitted fails before any work."""
        if self.max_admitted is not None and cost > self.max_admitted:
            raise E.too_many_sequences(cost, self.max_admitted)

    def _check_priority(self, req: Any) -> None:
        if req.priority != 0 and not self.config.serve.allow_client_priority:
            raise E.bad_request("priority is not accepted from clients on this server "
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
            raise E.bad_request("prompt must not be empty", "prompt")
        self._check_cost(len(items) * n)  # before tokenizing thousands of prompts
        out = [self.tokenize(p, True, "prompt") if isinstance(p, str) else list(p) for p in items]
        if any(not ids for ids in out):
            raise E.bad_request("prompt must not be empty", "prompt")
        return out

    def chat_prompt(self, req: P.ChatRequest) -> list[int]:
        tok = self.llm.tokenizer
        if tok is None:
            raise E.bad_request("this model has no tokenizer: chat is unavailable", "messages")
        try:
            messages, extra = template_input(req, tok.chat_template or DEFAULT_CHAT_TEMPLATE)
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                           **extra)
        except ValueError as e:
            raise E.bad_request(str(e), "messages") from None
        # The template already holds the special tokens it wants (vLLM's default).
        ids = self.tokenize(text, False, "messages")
        if not ids:
            raise E.bad_request("the rendered chat prompt is empty", "messages")
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
        param = constraint_field(req.structured_outputs)
        try:
            self.llm.frontend.validate_structured_outputs(sp.structured_outputs)
        except ValueError as e:
            raise E.bad_request(str(e), param) from None

    def _prepare(self, job: Job) -> None:
        """The engine's own checks, once per prompt (context length, vocab
        range, n cap, duplicate ids); queues nothing. Never truncates: an
        over-long request is a 400 context_length_exceeded."""
        self._check_alive()
        prompt_param = "prompt" if job.kind == "completion" else "messages"
        for i, (eid, ids, sp) in enumerate(zip(job.engine_ids, job.prompts, job.params)):
            prompt: Any = {"prompt_token_ids": ids, "multi_modal_data": {"image": job.images}} if job.images else ids
            try:
                job.prepared.append(self.llm.prepare(prompt, sp, eid, job.req.priority,
                                                     lora_request=job.lora))
                job.prompts[i] = job.prepared[-1].prompt_token_ids  # images expanded: what usage counts
            except EngineDeadError:
                raise E.engine_unavailable() from None
            except ContextLengthError as e:
                total = e.prompt_len + e.max_tokens
                raise E.bad_request(
                    f"This model's maximum context length is {e.max_model_len} tokens. However, you "
                    f"requested {total} tokens ({e.prompt_len} in the prompt, {e.max_tokens} for the "
                    f"completion). Reduce the prompt or the completion length.",
                    prompt_param, "context_length_exceeded") from None
            except ParamError as e:  # a SamplingParams field the engine bounds (n cap, vocab)
                raise E.bad_request(str(e), e.param) from None
            except ValueError as e:  # the prompt itself (empty, ids out of range, adapter)
                raise E.bad_request(str(e), prompt_param) from None

    @staticmethod
    def _request_id(meta: RequestMeta) -> str:
        if not _REQUEST_ID_RE.match(meta.request_id):
            raise E.bad_request("X-Request-Id must be 1-128 characters of [A-Za-z0-9._:-]",
                                "X-Request-Id")
        return meta.request_id

    def _new_job(self, kind: str, meta: RequestMeta, req: Any, prompts: list[list[int]],
                 sp: SamplingParams) -> Job:
        """The job's ids and params; nothing checked against the engine yet."""
        self._check_cost(len(prompts) * sp.n)
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{self._request_id(meta)}"
        eids = [rid] if len(prompts) == 1 else [f"{rid}-p{i}" for i in range(len(prompts))]
        return Job(kind, rid, eids, prompts, [sp] * len(prompts), req)

    def _ready(self, job: Job, meta: RequestMeta) -> Job:
        """The engine's own checks (prepare), then the session preference."""
        self._prepare(job)
        # Data parallel: a soft preference for the engine this session used last.
        session = meta.session or getattr(job.req, "user", None)
        for prep in job.prepared:
            prep.session = session[:256] if session else None
        return job

    # ---- endpoints ---------------------------------------------------------------

    async def completions(self, req: P.CompletionRequest, meta: RequestMeta) -> Reply:
        """req: validated by FastAPI (the route's body model) or validate_model."""
        return await self.run(await RP.off_loop(self.prep_pool, self.completion_job, req, meta))

    async def chat(self, req: P.ChatRequest, meta: RequestMeta) -> Reply:
        return await self.run(await RP.off_loop(self.prep_pool, self.chat_job, req, meta))

    def _decode(self, ids: list[int]) -> str:
        tok = self.llm.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""

    def completion_job(self, req: P.CompletionRequest, meta: RequestMeta) -> Job:  # sync: any thread
        P.check_unsupported(req)
        lora = self.check_model(req.model)
        # max_tokens 0 with echo (score the prompt only): one token is sampled
        # and dropped. Without echo, 0 stays an error (nothing to return).
        prompt_only = req.max_tokens == 0 and req.echo
        sp = self._params(req, 1 if prompt_only else req.max_tokens)
        if req.echo and req.logprobs is not None:
            sp = sp.clone(prompt_logprobs=req.logprobs)
        prompts = self._completion_prompts(req.prompt, sp.n)
        job = self._new_job("completion", meta, req, prompts, sp)
        job.lora, job.drop_output = lora, prompt_only
        if req.echo:
            job.echo = [p if isinstance(p, str) else self._decode(ids)
                        for p, ids in zip(self._prompt_items(req.prompt), prompts)]
        return self._ready(job, meta)

    def chat_job(self, req: P.ChatRequest, meta: RequestMeta) -> Job:  # sync: any thread
        """A validated chat request, ready to run (also /v1/responses' path)."""
        P.check_unsupported(req)
        lora = self.check_model(req.model)
        plan = tool_plan(req, self.config.serve.tool_call_parser,
                         self.llm.frontend.validate_structured_outputs,
                         self.config.structured_outputs.allow_additional_properties)
        sp = self._params(req, P.chat_max_tokens(req)[0], plan)
        req, images = split_images(req, self.llm.frontend.image_placeholder(), media_policy(self.config),
                                   self.config.multimodal.limit_per_prompt)
        job = self._new_job("chat", meta, req, [self.chat_prompt(req)], sp)
        job.tools, job.lora, job.images = plan and ToolSession(plan), lora, images
        return self._ready(job, meta)

    def models(self) -> dict[str, Any]:
        data = [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "conveyor",
                 "max_model_len": self.config.max_model_len}]
        data += adapter_models(self.llm.frontend.loras, self.model_name,
                                           self.config.max_model_len)
        return {"object": "list", "data": data}

    async def health(self) -> dict[str, str]:
        """{"status": "ok" | "recovering"}; an unhealthy engine raises the 503."""
        if self.draining:
            raise E.engine_unavailable("the server is shutting down")
        try:
            status = await self.check_engine()
        except Exception as e:  # noqa: BLE001 - any failure means unhealthy
            log.warning("health check failed: %s", e)
            raise E.engine_unavailable() from None
        # 200 while a lost worker group is rebuilt: Serve must not replace us.
        return {"status": status}

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

    # ---- running -------------------------------------------------------------------

    def _streams(self, job: Job) -> list[AsyncIterator[RequestOutput]]:
        interval = self.config.serve.stream_batching_interval_ms / 1000.0 if job.req.stream else 0.0
        return [self.llm.generate(prep.prompt_token_ids, sp, min_interval_s=interval, prepared=prep)
                for prep, sp in zip(job.prepared, job.params)]

    def _admit(self, job: Job) -> None:
        """Take the job's engine ids (AsyncLLM.reserve_ids: the one check that
        they are not in flight) and its slots (one per engine request: prompts x n)."""
        try:
            self.llm.reserve_ids(job.engine_ids)
        except ValueError as e:
            raise E.bad_request(str(e), "X-Request-Id") from None
        if self.max_admitted is not None and self.admitted + job.cost > self.max_admitted:
            self.llm.release_ids(job.engine_ids)
            raise E.at_capacity(self.max_admitted)
        self.admitted += job.cost
        self.metrics.in_progress.inc()

    def _release(self, job: Job) -> None:
        self.admitted -= job.cost
        self.llm.release_ids(job.engine_ids)
        self.metrics.in_progress.dec()

    async def run(self, job: Job) -> Reply:
        """A validated job's reply: its SSE stream, or its JSON body."""
        if job.req.stream:
            return self.stream(job, self.sse(job))
        return await self.collect(job)

    async def collect(self, job: Job) -> dict[str, Any]:
        """Run a non-streamed job to its JSON body, holding its admission slots."""
        self._admit(job)
        try:
            return await self.builder.collect(job, self._streams(job))
        finally:
            self._release(job)
            await self._abort_all(job)

    def stream(self, job: Job, chunks: AsyncIterator[bytes]) -> EventStream:
        """Admit the job; `chunks` (built over `sse(job)`) go out, and the
        slots come back when the sender calls `release`."""
        self._admit(job)
        return EventStream(chunks, lambda: self._release(job))

    async def _abort_all(self, job: Job) -> None:
        # No-op for finished requests; makes a cancelled handler's abort explicit.
        for eid in job.engine_ids:
            await self.llm.abort(eid)

    async def sse(self, job: Job) -> AsyncIterator[bytes]:
        """The job's SSE chunks: errors after the stream started go in-band,
        then [DONE]. Cancellation (client gone) propagates and closes the
        engine streams; they are aborted however the stream ends."""
        try:
            async for chunk in self.builder.sse(job, self._streams(job)):
                yield chunk
        except E.APIError as e:
            yield B.sse(e.body())
        except EngineDeadError:
            yield B.sse(E.engine_unavailable().body())
        except UnsendableRequestError as e:
            yield B.sse(E.bad_request(str(e)).body())
        except Exception:
            log.exception("stream %s failed", job.rid)
            yield B.sse(E.internal_error().body())
        finally:
            await self._abort_all(job)
        yield B.SSE_DONE
