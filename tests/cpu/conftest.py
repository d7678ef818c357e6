"""Shared test setup. TRITON_INTERPRET must be set before any kernel module is
imported, so it is set here, at collection time.

Layout: unit/ (no Ray, no model: `make test-fast`), integration/ (the rest).
This folder holds what they share, imported as top-level modules
(`from llm_utils import make_checkpoint`): it goes on sys.path here, and
processes the tests spawn inherit it (worker classes named "hang_worker:..."),
while scripts they run as files are found through repo_paths.SUPPORT."""
from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
# Ray Serve shuts a proxy down after three 5 s readiness checks; on a loaded
# 2-core CI box (two pytest workers and their engines) a proxy once took
# longer to come up, and a fixture died with it. The Ray instances the tests
# start inherit this.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
SUPPORT = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(SUPPORT))
for _p in (SUPPORT, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from tiny_models import FAMILIES  # noqa: E402  (needs SUPPORT on the path)


def pytest_sessionstart(session: object) -> None:
    """Build the CPU attention kernel once, before any test forks workers: every
    engine process then loads the cached build instead of waiting on the compile."""
    from conveyor.kernels import cpu_attention

    cpu_attention.available()


@pytest.fixture(scope="module", autouse=True)
def _no_leaked_distributed_world(request):
    """A test module that leaves this process's torch.distributed world behind
    (an in-process engine never shut down) fails here, after its own module
    fixtures are gone, and the world is torn down, so the next module's
    in-process engine can start."""
    yield
    from conveyor.parallel import state

    if state.is_initialized():
        state.destroy_distributed()
        pytest.fail(f"{request.node.nodeid} left this process's distributed world initialized "
                    "(an in-process engine was not shut down)")


# ---- one tiny checkpoint per family and test process ----------------------------------------
# tiny_llama, tiny_llama3, tiny_mistral, tiny_qwen2, tiny_qwen2_tied, tiny_qwen3: the
# default checkpoint of the family (llm_utils.make_checkpoint: weights, config and the
# tiny tokenizer), built on first use and shared by every module of the process (under
# xdist, of the worker). Read only: a test that writes into a checkpoint, or needs
# other config values or weights, builds its own.

def _checkpoint_fixture(family: str):
    name = "tiny_" + family.replace("-", "_")

    def checkpoint(tmp_path_factory) -> str:
        from llm_utils import make_checkpoint

        return make_checkpoint(family, str(tmp_path_factory.mktemp(name) / family))

    checkpoint.__doc__ = f"The default tiny {family} checkpoint (read only), shared by the session."
    return name, pytest.fixture(scope="session", name=name)(checkpoint)


globals().update(_checkpoint_fixture(family) for family in FAMILIES)
