"""Ray Serve application: the OpenAI API, one AsyncLLM engine per replica.

    serve run configs/serve-tiny.yaml          # import_path conveyor.cluster.serve_app:build_app
    python -c "from conveyor.cluster.serve_app import run_serve; run_serve('configs/tiny-cpu.yaml')"

Sizing (per replica): a replica admits serve.max_ongoing_requests (default
twice scheduler.max_num_seqs) + serve.max_queued_requests (default 4x that)
completion/chat requests, all handed to the engine: its own FCFS queue refills
a freed batch slot on the next step, where a queue held in Serve's proxy
leaves slots idle while the router backs off. Past that the replica answers
429 + Retry-After in the OpenAI error shape. A dead engine
answers 503 (engine_unavailable) and fails Serve's health check, so Serve
replaces the replica; a draining replica answers 503 on /health.

Processes (parallel.engine_actor, on in replicas): the replica runs HTTP and the
AsyncLLM frontend; EngineCore runs in an EngineCoreActor in the replica's
placement group. The engine step and the per-token HTTP work then never
contend for one GIL (in one process, every torch op that releases the GIL
lets the event loop in, and the engine thread waits up to the 5 ms switch
interval to get it back).

The API key is read in each replica from the env var named by
serve.api_key_env: set it where the replicas start (for a local cluster, in the
shell that runs `serve run` / `conveyor serve`). The secret never goes into the
deployment config.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any

from ray import serve
from ray.serve import Application

from conveyor.cluster.engine_actor import cpu_layout
from conveyor.cluster.engine_actor.actor import CoreActorPlacement
from conveyor.cluster.engine_actor.client import RayCoreClient
from conveyor.cluster.openai.responses_api.store import RayResponseStore
from conveyor.engine.config import EngineConfig, check_model_dir, load_config
from conveyor.engine.core_client import NOT_DATA_PARALLEL
from conveyor.executors.ray_placement import host_and_worker_bundles

log = logging.getLogger("conveyor.serve")

RETRY_AFTER_S = 1.0
SERVE_HEADROOM = 8
MIN_SERVE_QUEUE = 256
_ARG_KEYS = {"config", "overrides", "device", "name"}


# ---- pure sizing helpers (unit-tested) --------------------------------------------

def default_max_ongoing(config: EngineConfig) -> int:
    if config.serve.max_ongoing_requests is not None:
        return config.serve.max_ongoing_requests
    # Twice the batch: a freed batch slot refills from the engine's own
    # waiting queue on the next step. Serve's router backs off while every
    # replica is full, so a queue held in the proxy leaves slots idle for tens
    # of ms (measured: TTFT ~1 s and idle CPU at concurrency 48 with 36 here).
    return 2 * config.scheduler.max_num_seqs


def default_max_queued(config: EngineConfig, max_ongoing: int) -> int:
    q = config.serve.max_queued_requests
    return q if q is not None else 4 * max_ongoing


def replica_resources(config: EngineConfig, use_gpu: bool) -> dict[str, Any]:
    """Deployment options that reserve one replica's resources.

    executor "ray": a placement group per replica, bundle 0 = the replica
    actor itself ({"CPU": 1}, shared with the EngineCoreActor), then one bundle
    per engine worker ({"GPU": 1} on GPU, {"CPU": 1} on CPU), with the
    configured strategy. Serve captures child actors into it, so the engine
    places worker i on bundle i + 1 of the current placement group.
    parallel.engine_actor with another executor: bundle 0 = the replica, bundle 1
    = the EngineCoreActor that runs the model ({"CPU": 1} + its GPUs).
    Otherwise the engine lives in the replica's process tree.
    """
    world = config.world_size
    strategy = config.parallel.placement_strategy
    if config.parallel.data_parallel_size > 1:
        # The engines are EngineCoreActors of their own (data_parallel_client),
        # outside the replica's reservation: each may land on any node.
        return {"ray_actor_options": {"num_cpus": 1}}
    if config.parallel.executor == "ray":
        return {"ray_actor_options": {"num_cpus": 1},
                "placement_group_bundles": host_and_worker_bundles(config, use_gpu),
                "placement_group_strategy": strategy}
    place = core_actor_placement(config, use_gpu)
    if place is not None:  # the actor's own bundle holds exactly what it asks for
        core = {"CPU": place.num_cpus, **({"GPU": place.num_gpus} if place.num_gpus else {})}
        return {"ray_actor_options": {"num_cpus": 1},
                "placement_group_bundles": [{"CPU": 1.0}, core],
                "placement_group_strategy": strategy}
    return {"ray_actor_options": {"num_cpus": 1, "num_gpus": world if use_gpu else 0}}


def core_actor_placement(config: EngineConfig, use_gpu: bool) -> CoreActorPlacement | None:
    """Where the replica puts its EngineCoreActor (None: in-process core)."""
    if not config.core_in_actor(serving=True):
        return None
    if config.parallel.executor == "ray":
        return CoreActorPlacement()
    return CoreActorPlacement(bundle_index=1, num_cpus=1.0,
                              num_gpus=float(config.world_size) if use_gpu else 0.0)


def data_parallel_client(config: EngineConfig, use_gpu: bool) -> Any:
    """parallel.data_parallel_size engines behind the router, each an
    EngineCoreActor with its own resources (executor "ray": its own worker
    placement group; otherwise the model in the actor, with its GPUs)."""
    from conveyor.engine.dp.client import DataParallelClient

    if config.serve.replicas > 1:  # the engines are the app's, not this replica's
        from conveyor.cluster.engine_pool import pooled_client
        return pooled_client(config, use_gpu)
    place = CoreActorPlacement.of_engine(config, use_gpu)
    return DataParallelClient(config, spawn=lambda c: RayCoreClient.launch(c, place))


def max_admitted(config: EngineConfig) -> int:
    """Completion/chat requests one replica takes at once: max_ongoing_requests
    + max_queued_requests. All of them go to the engine, whose own FCFS queue
    holds the ones beyond its batch (they hold no KV until scheduled); past
    this the replica answers 429 in the OpenAI error shape."""
    ongoing = default_max_ongoing(config)
    return ongoing + default_max_queued(config, ongoing)


def deployment_options(config: EngineConfig, use_gpu: bool) -> dict[str, Any]:
    # Serve's per-replica cap sits a little above ours, so /health, /metrics
    # and /v1/models still get in while generation is at capacity. Serve's
    # queue holds requests its router has not yet assigned to a replica (a
    # burst of 5 already passes 2 on 2 cores); past it Serve answers a
    # plain-text 429 (its body is not configurable), so it is sized to let
    # the replica's OpenAI-shaped 429 answer in all but a flood.
    admitted = max_admitted(config)
    return {"num_replicas": config.serve.replicas,
            "max_ongoing_requests": admitted + SERVE_HEADROOM,
            "max_queued_requests": max(admitted, MIN_SERVE_QUEUE),
            "backpressure_config": {"status_code": 429, "retry_after_s": RETRY_AFTER_S},
            "health_check_period_s": 5.0, "graceful_shutdown_timeout_s": 30.0,
            **replica_resources(config, use_gpu)}


# ---- the deployment ------------------------------------------------------------------

@serve.ingress()
class OpenAIDeployment:
    """One replica: an AsyncLLM plus the OpenAI FastAPI app built on it."""

    def __init__(self, config_path: str, overrides: dict[str, Any], use_gpu: bool) -> None:
        from conveyor.cluster.openai.metrics import ServeMetrics
        from conveyor.cluster.openai.server import OpenAIServer, model_name_of
        from conveyor.engine.frontend.async_client import AsyncLLM

        self.config = load_config(config_path, **overrides)
        check_model_dir(self.config, source=config_path)
        t0 = time.monotonic()
        place = core_actor_placement(self.config, use_gpu)
        if self.config.parallel.data_parallel_size > 1:
            place = None
        if place is not None and (split := cpu_layout.plan(self.config, use_gpu)) is not None:
            place = dataclasses.replace(place, engine_cpus=split.engine)
            cpu_layout.pin_process(split.frontend)
            log.info("replica threads on cores %s, engine step thread on %s",
                     split.frontend, split.engine)
        client = RayCoreClient.launch(self.config, place) if place is not None else None
        if self.config.parallel.data_parallel_size > 1:
            client = data_parallel_client(self.config, use_gpu)
            # /admin/reload and SIGHUP read the file again (conveyor/engine/dp/scaling.py).
            client.scaler.config_source = lambda: load_config(config_path, **overrides)
        try:
            self.llm = AsyncLLM(self.config, client)
        except BaseException:
            if client is not None:  # do not leave its EngineCoreActor behind
                client.shutdown()
            raise
        log.info("engine for %s ready in %.1fs", model_name_of(self.config), time.monotonic() - t0)
        name = model_name_of(self.config)
        self.server = OpenAIServer(self.llm, self.config, ServeMetrics(self.llm, name),
                                   max_admitted=max_admitted(self.config))
        # Stored /v1/responses live in the cluster, shared by every replica.
        sc = self.config.serve
        self.server.response_store = RayResponseStore(sc.responses_store_dir, sc.responses_max_entries,
                                                      sc.responses_ttl_s)

    def __serve_build_asgi_app__(self) -> Any:
        from conveyor.cluster.openai.app import build_api

        env = self.config.serve.api_key_env
        key = os.environ.get(env) if env else None
        if env and not key:
            raise RuntimeError(f"serve.api_key_env names {env!r}, which is not set in the replica")
        return build_api(self.server, api_key=key, echo_request_id=False)

    async def reload(self) -> dict[str, Any]:
        """Read the config file again and roll the engines over to it
        (`conveyor serve` calls this on SIGHUP); {"error": ...} when refused."""
        import asyncio

        admin = self.llm.client.admin
        if admin is None:
            return {"error": NOT_DATA_PARALLEL}
        try:
            return await asyncio.get_running_loop().run_in_executor(None, admin.reload)
        except (ValueError, TimeoutError) as e:
            return {"error": str(e)}

    async def check_health(self) -> None:
        """Serve's replica health check: raising makes Serve replace us."""
        if not self.server.draining:
            await self.server.check_engine()

    async def __del__(self) -> None:
        # Serve calls this even when __init__ failed half-way: shut down only
        # what was built.
        server, llm = getattr(self, "server", None), getattr(self, "llm", None)
        if server is not None:
            server.draining = True
        if llm is not None:
            await llm.shutdown()


# ---- application builders -----------------------------------------------------------

def _use_gpu(device: str) -> bool:
    if device in ("cpu", "cuda"):
        return device == "cuda"
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def _absolute_overrides(config: EngineConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """Replicas run in other processes (maybe other dirs): pin relative model
    paths to this process's working directory."""
    out = dict(overrides)
    out["model"] = os.path.abspath(config.model.path)
    if config.model.tokenizer:
        out["tokenizer"] = os.path.abspath(config.model.tokenizer)
    return out


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder (import_path `conveyor.cluster.serve_app:build_app`).

    args: config (engine YAML, relative to the working directory), optional
    overrides (flat engine keyword arguments as LLM(...) takes, or dotted key
    paths such as "serve.stream_interval"), device ("auto" | "cpu" | "cuda"),
    name.
    """
    unknown = set(args) - _ARG_KEYS
    if unknown or "config" not in args:
        raise ValueError(f"build_app args need 'config' and accept only {sorted(_ARG_KEYS)}; "
                         f"got unknown {sorted(unknown)}")
    path = os.path.abspath(str(args["config"]))
    overrides = dict(args.get("overrides") or {})
    config = load_config(path, **overrides)  # fail at deploy time, not in a replica
    check_model_dir(config, source=path)
    use_gpu = _use_gpu(str(args.get("device", "auto")))
    opts = deployment_options(config, use_gpu)
    dep = serve.deployment(OpenAIDeployment, name=str(args.get("name", "OpenAIDeployment")))
    return dep.options(**opts).bind(path, _absolute_overrides(config, overrides), use_gpu)


def replica_cpus(config: EngineConfig, use_gpu: bool) -> float:
    """Logical CPUs one replica reserves (its placement group, or its actor;
    with data parallel, its engines' actors and their workers too, as many
    engines as autoscaling may start)."""
    p = config.parallel
    if p.data_parallel_size > 1:
        per_engine = (p.num_cpus_per_worker * config.world_size if p.executor == "ray" else
                      (0.0 if use_gpu else p.num_cpus_per_worker) + (1.0 if use_gpu else 0.0))
        engines = max(p.data_parallel_size, config.serve.max_engines or 0)
        return 1.0 + engines * per_engine / config.serve.replicas  # engine_pool: shared
    opts = replica_resources(config, use_gpu)
    bundles = opts.get("placement_group_bundles")
    if bundles:
        return sum(b.get("CPU", 0.0) for b in bundles)
    return float(opts["ray_actor_options"].get("num_cpus", 1))


def wants_direct_ingress(config: EngineConfig, starts_ray: bool) -> bool:
    """serve.direct_ingress resolved: None (auto) is on exactly when this
    process starts Ray itself, the only place RAY_SERVE_ENABLE_DIRECT_INGRESS
    can still reach every Ray process (measured: the proxy hop costs the 30M
    model ~10-25% of its served throughput on 2 cores, BENCHMARKS.md)."""
    d = config.serve.direct_ingress
    return starts_ray if d is None else d


def enable_direct_ingress() -> None:
    """Turn on Ray Serve's direct ingress for a Ray instance this process is
    about to start (its processes inherit the environment; Serve reads these
    at import). A replica that stops keeps its port open for the drain period:
    5 s here instead of Serve's 30, unless set already."""
    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "5")


def direct_ingress_urls(app_name: str, host: str) -> list[str]:
    """The replicas' own API URLs when direct ingress is on ([] otherwise).
    Uses the controller's target groups (Serve's alpha API): best effort."""
    import ray

    try:
        from ray.serve.context import _get_global_client

        groups = ray.get(_get_global_client()._controller.get_target_groups.remote(app_name), timeout=30)
        ports = sorted({t.port for g in groups if str(g.protocol).endswith("HTTP") for t in g.targets})
    except Exception as e:  # noqa: BLE001 - only a hint for the user
        log.warning("could not list direct ingress ports: %s", e)
        return []
    # Each replica binds serve.host; the controller reports node IPs.
    return [f"http://{host}:{p}" for p in ports if p >= 30000]


def run_serve(config_path: str, *, blocking: bool = True, app_name: str = "conveyor",
              route_prefix: str = "/", **app_args: Any) -> str:
    """Start Serve on the configured host/port, deploy the app, return its URL.
    Used by `conveyor serve CONFIG`; blocking=True serves until Ctrl-C.
    With direct ingress (serve.direct_ingress; auto: on when this call starts
    Ray) the replicas' own URLs are logged too (see direct_ingress_urls)."""
    import ray

    config = load_config(config_path, **dict(app_args.get("overrides") or {}))
    if not ray.is_initialized():
        direct = wants_direct_ingress(config, starts_ray=not os.environ.get("RAY_ADDRESS"))
        if direct:
            enable_direct_ingress()
        ray.init()
    else:
        direct = os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1"
        if config.serve.direct_ingress and not direct:
            log.warning("serve.direct_ingress needs RAY_SERVE_ENABLE_DIRECT_INGRESS=1 in every Ray "
                        "process: export it before `ray start`")
    serve.start(http_options={"host": config.serve.host, "port": config.serve.port})
    serve.run(build_app({"config": config_path, **app_args}), name=app_name,
              route_prefix=route_prefix, blocking=False)
    url = f"http://{config.serve.host}:{config.serve.port}{route_prefix.rstrip('/')}"
    log.info("serving %s at %s/v1", app_name, url)
    if direct:
        for d_url in direct_ingress_urls(app_name, config.serve.host):
            log.info("replica direct ingress at %s/v1", d_url)
    if blocking:
        _serve_until_interrupted(app_name)
    return url


def reload_app(app_name: str = "conveyor") -> dict[str, Any]:
    """Ask the app's replica to read its config file again and roll its
    engines over to it (OpenAIDeployment.reload); {"error": ...} when refused.
    Logged either way."""
    log.info("reloading the config of %s", app_name)
    try:
        result = serve.get_app_handle(app_name).reload.remote().result()
    except Exception as e:  # noqa: BLE001 - the server keeps serving the old config
        result = {"error": repr(e)}
    log.log(logging.ERROR if "error" in result else logging.INFO, "reload: %s", result)
    return result


def wait_reloading_on_sighup(app_name: str, stop: threading.Event) -> None:
    """Block until `stop` is set; each SIGHUP meanwhile reloads the app's config."""
    hup = threading.Event()
    if threading.current_thread() is threading.main_thread():  # only there can a handler be set
        signal.signal(signal.SIGHUP, lambda *_: hup.set())
    while not stop.is_set():
        if hup.wait(1.0):
            hup.clear()
            reload_app(app_name)


def _serve_until_interrupted(app_name: str) -> None:
    """Block until Ctrl-C; each SIGHUP reloads the config (reload_app)."""
    try:
        wait_reloading_on_sighup(app_name, threading.Event())
    except KeyboardInterrupt:
        serve.delete(app_name)
