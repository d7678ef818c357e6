"""Shared test setup. TRITON_INTERPRET must be set before any kernel module is
imported, so it is set here, at collection time."""
from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


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
