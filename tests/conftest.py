"""Setup shared by tests/cpu and tests/compat."""
from __future__ import annotations

import os
import tempfile

import pytest

# Under pytest-xdist (make test runs two workers) each worker's Ray instances
# live in a temp root of their own, inherited by the processes it starts: a
# `ray.init()` that joins "the latest cluster on this machine" (conveyor
# serve, the demo) then only ever finds its own worker's.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker and "RAY_TMPDIR" not in os.environ:
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix=f"ray-{_worker}-", dir="/tmp")

# Rough wall seconds of the slowest files on 2 cores (pytest --durations).
# Collected first. Under make test's xdist, files go out by number of tests
# (xdist's loadscope reorder), this order breaking ties: keeping this order
# outright (--no-loadscope-reorder) ran the heavy Ray files on both workers at
# once and was slower than xdist's mix of heavy and light files.
_SLOW_FILES = {
    "test_serve.py": 120, "test_batch.py": 110, "test_ray_executor.py": 110, "test_parallel.py": 100,
    "test_engine_actor_recovery.py": 85, "test_recovery.py": 80, "test_data_plane_security.py": 80,
    "test_cli.py": 67, "test_node_loss.py": 50, "test_kernels.py": 45, "test_openapi_fuzz.py": 40,
    "test_serve_recovery.py": 40, "test_recovery_visibility.py": 40, "test_structured_outputs.py": 40,
    "test_clients.py": 40, "test_llm.py": 40, "test_spec_decode.py": 30, "test_async_scheduling.py": 30,
    "test_lora.py": 30, "test_migration.py": 25, "test_autoscale.py": 20,
}


def pytest_collection_modifyitems(items: list) -> None:
    """Slowest files first; tests keep their order within a file (stable sort)."""
    items.sort(key=lambda item: -_SLOW_FILES.get(os.path.basename(str(item.fspath)), 0))


# ---- one local Ray instance per test process, for modules that only need "a Ray" ----------
# Starting and stopping Ray costs several seconds a module under load. Modules
# that ask for `ray_local` share one instance, started by the first and kept up
# for the next; a module that does not ask for it (it starts Ray its own way:
# a Serve app, a multi-node cluster, a CPU count of its own) finds none
# running. Modules that share it clean up their engines and Serve apps, which
# the per-module actor checks in those tests already assert.
_SHARED_RAY_CPUS = 8


def _module_uses_shared_ray(request) -> bool:
    return any("ray_local" in item.fixturenames for item in request.session.items
               if item.module is request.module)


def _stop_ray() -> None:
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _ray_only_where_shared(request):
    if not _module_uses_shared_ray(request):
        _stop_ray()
    yield


@pytest.fixture(scope="module")
def ray_local():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=_SHARED_RAY_CPUS, include_dashboard=False)
    yield


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_stops_at_the_end():
    yield
    _stop_ray()
