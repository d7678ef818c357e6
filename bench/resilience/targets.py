"""The systems a resilience scenario runs against, each a context manager
that brings it up, yields a ``System`` and takes it down again:

- ``serve``: our Serve app in this process (its Ray workers are children of
  this process, so a fault can find and kill them), over loopback HTTP;
- ``uvicorn``: one AsyncLLM behind uvicorn in a child process, no Ray;
- ``engines``: data-parallel AsyncLLM engines in this process, no HTTP.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.lib import launch
from bench.lib.models import model_dir
from bench.lib.proc_tree import ray_server_pids
from bench.lib.sse import auth_headers, loopback_only

OUT = os.path.join(launch.REPO, "bench", "out")


@dataclass
class System:
    """What the load and the faults act on: a URL (HTTP targets) or the
    AsyncLLM (engines), the request headers, the served app's processes."""
    kind: str
    url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    pids: dict[int, str] = field(default_factory=dict)
    config: Any = None  # engines: the EngineConfig
    llm: Any = None  # engines: the AsyncLLM while a session is open

    @asynccontextmanager
    async def session(self) -> AsyncIterator[System]:
        """Inside the event loop that drives the load: the engines' AsyncLLM
        is made here (it belongs to the loop it starts in) and shut down after."""
        if self.kind != "engines":
            yield self
            return
        from conveyor.engine.frontend.async_client import AsyncLLM

        self.llm = AsyncLLM(self.config)
        try:
            yield self
        finally:
            await self.llm.shutdown()
            self.llm = None


@contextmanager
def serve(p: dict[str, Any]) -> Iterator[System]:
    """Our Serve app on the demo model (built if missing) from ``config``: an
    engine YAML's path, or a whole config tree (written to a temporary file)."""
    from conveyor.cluster.demo.model import ensure_demo_model

    ensure_demo_model(p["model"])
    config, tmp = p["config"], None
    if isinstance(config, dict):
        fd, tmp = tempfile.mkstemp(suffix=".yaml", prefix="resilience-")
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)  # JSON is YAML
        config = tmp
    url = launch.serve_in_process(config, {"model": os.path.abspath(p["model"]), "serve.port": p["port"]})
    try:
        loopback_only(url)
        yield System("serve", url=url, headers=auth_headers(os.environ.get("CONVEYOR_API_KEY")),
                     pids=ray_server_pids())
    finally:
        launch.stop_in_process()
        if tmp:
            os.unlink(tmp)


@contextmanager
def uvicorn(p: dict[str, Any]) -> Iterator[System]:
    """One AsyncLLM (uniproc) behind uvicorn on ``model`` (the tiny Llama
    built there if missing), a child process."""
    from conveyor.parallel.ports import free_port

    s = launch.uvicorn_engine(model_dir("tiny", p["model"]), free_port(), p["engine"])
    try:
        url = launch.start(s, os.path.join(OUT, "resilience"), 120.0)
        yield System("uvicorn", url=url)
    finally:
        launch.stop(s)


@contextmanager
def engines(p: dict[str, Any]) -> Iterator[System]:
    """``engines`` in-process AsyncLLM engines (data parallel) of the 30M Llama
    (vocab 512; built at ``model`` if missing),
    parallel.max_restarts 0: a killed engine is lost, not rebuilt in place
    (started by System.session, inside the load's event loop)."""
    from conveyor.engine.config import build_config

    path = model_dir("30m_v512", p["model"])
    cfg = build_config(model=path, max_model_len=1024, data_parallel_size=p["engines"],
                       max_num_seqs=p["max_num_seqs"], num_gpu_blocks=p["max_num_seqs"] * p["blocks_per_seq"],
                       **{"parallel.max_restarts": 0})
    yield System("engines", config=cfg)


TARGETS = {"serve": serve, "uvicorn": uvicorn, "engines": engines}
