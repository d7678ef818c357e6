"""Batch engines: turn one OpenAI Batch line into one output record.

`LineRunner` owns an AsyncLLM and the OpenAI server's request handling; each
line goes through exactly the handlers a POST to its URL would reach (data in,
data out: no HTTP), so results have the HTTP API's response bodies.
`LocalEngine` runs one in this process; `ActorEngine` runs one in a Ray actor
with a placement group of its own (`--data-parallel N`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from conveyor.cluster.openai import errors as E
from conveyor.cluster.openai import request_prep as RP
from conveyor.cluster.openai.job import RequestMeta
from conveyor.cluster.openai.protocol import ChatRequest, CompletionRequest
from conveyor.engine.config import EngineConfig
from conveyor.engine.errors import EngineDeadError, UnsendableRequestError
from conveyor.engine.frontend.json_limits import utf8_problem
from conveyor.executors.ray_placement import host_and_worker_bundles

if TYPE_CHECKING:  # the engine loads on first use (see LineRunner.start)
    from conveyor.cluster.batch.token_journal import LineJournal
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.frontend.async_client import AsyncLLM

log = logging.getLogger("conveyor.batch")

URLS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def make_record(custom_id: str, request_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """One output line. Errors keep the HTTP error body under `response` and
    repeat its code/message under `error` (OpenAI batch error shape)."""
    err = body.get("error") if status != 200 else None
    error = {"code": err.get("code"), "message": err.get("message")} if isinstance(err, dict) else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": error}


# ---- one engine: lines -> records ------------------------------------------------------

class LineRunner:
    """One AsyncLLM and the OpenAI request handling on top of it."""

    def __init__(self, llm: AsyncLLM, server: OpenAIServer, journal: LineJournal | None = None) -> None:
        """Lines on an engine that runs already (`start` starts one); journal:
        the engine's client when its generated tokens are journaled."""
        self.llm, self.server, self.journal = llm, server, journal

    @classmethod
    def start(cls, config: EngineConfig, journal_path: str | None = None,
              restore_from: str | None = None) -> LineRunner:
        """Start an engine for `config` (blocks: run it off the event loop)."""
        # Here, not at the top: `conveyor --help` and the job's parser never load the engine.
        from conveyor.cluster.batch.token_journal import journaled_client
        from conveyor.cluster.openai.server import OpenAIServer
        from conveyor.engine.frontend.async_client import AsyncLLM

        # journal_path: generated tokens survive a lost job (conveyor/cluster/batch/token_journal.py);
        # restore_from: a data-parallel job's merged journal this engine resumes from.
        journal = journaled_client(config, journal_path, restore_from) if journal_path else None
        llm = AsyncLLM(config, journal)
        return cls(llm, OpenAIServer(llm, config), journal)

    def _check_line(self, obj: dict[str, Any]) -> str:
        url, method, body = obj.get("url"), obj.get("method", "POST"), obj.get("body")
        if url not in URLS:
            raise E.APIError(400, f"unsupported url {url!r}; supported: {', '.join(URLS)}",
                             param="url", code="invalid_url")
        if method != "POST":
            raise E.bad_request(f"unsupported method {method!r}; batch lines use POST", "method",
                                "invalid_method")
        if not isinstance(body, dict):
            raise E.bad_request("body must be a JSON object (the request body)", "body", "invalid_json")
        if body.get("stream") is True:
            raise E.bad_request("stream is not supported in batch jobs", "stream", "unsupported_parameter")
        return URLS[url]

    async def run(self, obj: dict[str, Any]) -> dict[str, Any]:
        """The output record of one input line; raises EngineDeadError if the engine died (the job
        stops; finished lines stay in the output)."""
        await self.server.start()
        rid = f"batch-{uuid.uuid4().hex}" if self.journal is None else self.journal.line_id(obj)
        try:
            problem = utf8_problem(obj["custom_id"])
            if problem is not None:  # the line's error record still names it (escaped)
                raise E.bad_request(f"custom_id {problem}", "custom_id")
            status, body = 200, await self._body(self._check_line(obj), obj["body"], RequestMeta(rid))
        except E.APIError as e:
            status, body = e.status, e.body()
        except UnsendableRequestError as e:  # this line alone could not reach the engine
            status, body = 400, E.bad_request(str(e)).body()
        except EngineDeadError as e:  # never a line's own error: the line is not done
            raise EngineDeadError(f"engine failed: {self.llm.dead_error or e}") from None
        except Exception:
            log.exception("line %r failed", obj.get("custom_id"))
            status, body = 500, E.error_body("internal error", "internal_error", "internal_error")
        # 503 is the server's "engine unavailable": a dead engine, not this line.
        if status == 503 or self.llm.dead_error is not None:
            raise EngineDeadError(f"engine failed: {self.llm.dead_error or body}")
        if self.journal is not None:  # written next: its tokens need no journal any more
            self.journal.forget_line(rid)
        return make_record(obj["custom_id"], rid, status, body)

    async def _body(self, kind: str, body: dict[str, Any], meta: RequestMeta) -> dict[str, Any]:
        """The response body a POST of `body` would get (streaming is refused
        by _check_line, so the reply is the JSON body)."""
        if kind == "completion":
            job = await RP.off_loop(self.server.prep_pool, self.server.completion_job,
                                    E.validate_model(CompletionRequest, body), meta)
        else:
            job = await RP.off_loop(self.server.prep_pool, self.server.chat_job,
                                    E.validate_model(ChatRequest, body), meta)
        return await self.server.collect(job)

    async def close(self) -> None:
        await self.llm.shutdown()


class Engine(Protocol):
    max_in_flight: int

    async def run(self, obj: dict[str, Any]) -> dict[str, Any]: ...

    async def close(self) -> None: ...


@dataclass
class LocalEngine:
    runner: LineRunner
    max_in_flight: int

    async def run(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.runner.run(obj)

    async def close(self) -> None:
        await self.runner.close()



# ---- data parallel: one engine per Ray actor ------------------------------------------

_ACTOR_CLS: Any = None

def _engine_actor_cls() -> Any:
    """The Ray actor class, made on first use (`--help` and the uniproc path
    never import Ray). Async actor: its lines run concurrently on one loop."""
    global _ACTOR_CLS
    if _ACTOR_CLS is None:
        import ray

        @ray.remote(max_concurrency=100_000)
        class BatchEngineActor:
            def __init__(self, config_bytes: bytes, journal: tuple[str, str] | None = None) -> None:
                self.config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
                self.runner: LineRunner | None = None
                # (own file, the job's merged file), on the driver's file system:
                # an engine on a node without the output's directory runs without.
                if journal is not None and not os.path.isdir(os.path.dirname(journal[0]) or "."):
                    log.warning("%s: no such directory on this node; this engine keeps no token "
                                "journal", os.path.dirname(journal[0]))
                    journal = None
                self.journal = journal

            async def ready(self) -> bool:
                # Built off the event loop: engine start-up blocks on Ray calls.
                loop = asyncio.get_running_loop()
                j = self.journal or (None, None)
                self.runner = await loop.run_in_executor(None, LineRunner.start, self.config, *j)
                return True

            async def run(self, obj: dict[str, Any]) -> dict[str, Any]:
                assert self.runner is not None, "ready() first"
                return await self.runner.run(obj)

            async def close(self) -> None:
                if self.runner is not None:
                    await self.runner.close()

        _ACTOR_CLS = BatchEngineActor
    return _ACTOR_CLS


def engine_bundles(config: EngineConfig, use_gpu: bool) -> tuple[list[dict[str, float]], int]:
    """(placement group bundles, GPUs of the actor itself) for one engine.
    executor ray: bundle 0 = the actor (and its EngineCoreActor), bundles
    1..world = the workers, which RayExecutor finds in the current group (as
    in a Serve replica). Other executors run the workers in the actor's own
    process tree, so bundle 0 holds their GPUs."""
    world = config.world_size
    if config.parallel.executor == "ray":
        return host_and_worker_bundles(config, use_gpu), 0
    gpus = world if use_gpu else 0
    return [{"CPU": 1.0, **({"GPU": float(gpus)} if gpus else {})}], gpus


class ActorEngine:
    """One engine in a Ray actor with a placement group of its own."""

    def __init__(self, config: EngineConfig, index: int, max_in_flight: int,
                 journal: str | None = None) -> None:
        """journal: the job's token journal; this engine writes `journal.<index>`
        and resumes from `journal` (conveyor/cluster/batch/token_journal.py, data parallel)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.index, self.max_in_flight = index, max_in_flight
        self.placement_timeout_s = config.parallel.placement_timeout_s
        bundles, gpus = engine_bundles(config, ray.cluster_resources().get("GPU", 0) > 0)
        self.pg = placement_group(bundles, strategy=config.parallel.placement_strategy,
                                  name=f"conveyor-batch-{os.getpid()}-{index}")
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        # The engine's blocking Ray calls run on executor threads, never on the
        # actor's event loop; Ray's warning cannot tell the difference.
        env = {"RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0"}
        self.actor = _engine_actor_cls().options(
            num_cpus=1, num_gpus=gpus, scheduling_strategy=strategy, runtime_env={"env_vars": env},
            name=f"conveyor-batch-{os.getpid()}-{index}").remote(
                msgspec.msgpack.encode(config),
                (f"{os.path.abspath(journal)}.{index}", os.path.abspath(journal)) if journal else None)

    async def ready(self) -> None:
        import ray

        try:
            await asyncio.wait_for(self.pg.ready(), timeout=self.placement_timeout_s)
        except TimeoutError:
            raise EngineDeadError(f"engine {self.index}: placement group {self.pg.bundle_specs} not ready "
                                f"after {self.placement_timeout_s:g}s (parallel.placement_timeout_s); available: {ray.available_resources()}") from None
        await self.actor.ready.remote()

    async def run(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.actor.run.remote(obj)

    async def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            await asyncio.wait_for(self.actor.close.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001 - it may be dead already
            log.info("engine %d close: %r", self.index, e)
        ray.kill(self.actor, no_restart=True)
        remove_placement_group(self.pg)
