"""Third-party OpenAI clients against one served tiny model.

One session-scoped server: an AsyncLLM (in-process engine, no Ray) behind the
FastAPI app, served by uvicorn on 127.0.0.1 in a thread of its own. Every
client under test talks real HTTP to it, as a user's program would.

The weights are random, so these tests check only what does not depend on the
model's skill: the clients' requests are accepted, their responses parse, and
constrained outputs (schemas, forced tools) come back in the shapes the
clients expect."""
from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (ROOT, os.path.join(ROOT, "tests", "cpu")):
    if p not in sys.path:
        sys.path.insert(0, p)

from ray_nodes import free_port  # noqa: E402  (tests/cpu is on the path only from here)

MODEL = "tiny"
# litellm fetches a price table from GitHub at import unless told not to: tests stay offline.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


class _Server:
    """uvicorn + the app on their own event loop, in a daemon thread."""

    def __init__(self, ckpt: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._ckpt = ckpt
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="compat-server", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # reported to the fixture, never swallowed
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        import uvicorn

        from conveyor.cluster.openai.app import build_api
        from conveyor.cluster.openai.server import OpenAIServer
        from conveyor.engine.config import build_config
        from conveyor.engine.frontend.async_client import AsyncLLM

        cfg = build_config({"model": {"path": self._ckpt, "max_model_len": 4096},
                            "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 4096},
                            "serve": {"served_model_name": MODEL}})
        llm = AsyncLLM(cfg)
        srv = OpenAIServer(llm, cfg)
        await srv.start()
        config = uvicorn.Config(build_api(srv, api_key=None), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self.uvicorn = uvicorn.Server(config)
        serve = asyncio.ensure_future(self.uvicorn.serve())
        while not self.uvicorn.started and not serve.done():
            await asyncio.sleep(0.01)
        self._ready.set()
        try:
            await serve
        finally:
            await llm.shutdown()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(timeout=300)
        if self._error is not None:
            raise RuntimeError("compat server failed to start") from self._error

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self._thread.join(timeout=60)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from llm_utils import make_checkpoint

    return make_checkpoint("llama", str(tmp_path_factory.mktemp("compat") / "llama"),
                           max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(ckpt) -> Iterator[_Server]:
    s = _Server(ckpt)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server.url + "/v1"
