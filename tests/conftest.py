"""Setup shared by tests/cpu and tests/compat."""
from __future__ import annotations

import functools
import os
import re
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
    "test_lora.py": 30, "test_migration.py": 25, "test_multimodal.py": 25, "test_autoscale.py": 20,
}


# ---- markers (pyproject.toml): `ray` (starts Ray), `slow` (over ~10 s) -------------------------
# `ray` is found in the source: every test of a module that imports Ray or starts Ray
# nodes (ray_nodes.start_node), and every test that asks for `ray_local`. A test whose
# Ray starts out of sight (in a process it runs) is marked by hand.
_RAY_MODULE = re.compile(r"^\s*(?:import ray\b|from ray\b)|\bstart_node\(", re.M)

# `slow`: the tests over ~10 s, setup included (a module's fixtures count to its first
# test): `pytest --durations=0` of each file alone on 2 cores (2026-12-06), and for
# test_serve.py and test_wheel.py CI's `--durations`. "file::name" marks every
# parametrization, "file::name[id]" one.
SLOW_TESTS = {
    "test_autoscale.py::test_scale_down_and_reload_under_load_lose_no_request",  # 15 s
    "test_batch.py::test_batch_on_ray_executor_and_data_parallel",  # 26 s
    "test_batch.py::test_ray_job_submit",  # 19 s (CI 27)
    "test_cli.py::test_demo_builds_the_model_serves_and_answers",  # 17 s
    "test_cli.py::test_serve_prints_the_url_and_stops_on_sigint",  # 20 s
    "test_engine_actor_recovery.py::test_killed_engine_actor_behind_serve_costs_no_stream",  # 13-14 s
    "test_engine_actor_recovery.py::test_two_ingress_frontends_share_the_pools_engines",  # 11 s
    "test_engine_actor_recovery.py::test_two_ingress_replicas_behind_serve",  # 14 s (CI 18)
    "test_engine_actor_recovery.py::test_wedged_engine_actor_is_replaced",  # 15 s
    "test_migration.py::test_drain_and_engine_loss_move_requests_token_exact",  # 18 s
    "test_node_loss.py::test_lost_node_group_is_rebuilt_on_the_head",  # 50 s
    "test_openapi_fuzz.py::test_schemathesis_no_5xx_and_openai_errors",  # 39 s
    "test_parallel.py::test_tp_pp_parity[llama]",  # 10 s
    "test_ray_executor.py::test_ray_parity_with_uniproc[2-2]",  # 13 s
    "test_ray_executor.py::test_worker_death_mid_stream_is_recovered",  # 12 s (CI 22)
    "test_recovery.py::test_killed_rank_costs_no_request[2-1-1-on]",  # 12 s
    "test_recovery.py::test_ray_executor_rebuilds_its_group_in_a_new_placement_group[1-2-1]",  # 12 s
    "test_recovery_visibility.py::test_health_metrics_and_logs_during_and_after_recovery",  # 20 s
    "test_recovery_visibility.py::test_sigstopped_rank_is_detected_by_step_timeout_and_recovered",  # 12 s
    "test_serve.py::test_32_streams_survive_engine_loss_and_drain",  # CI 22 s
    "test_serve.py::test_backpressure_429",  # CI 18 s
    "test_serve_recovery.py::test_killed_worker_rank_costs_no_stream",  # 27 s
    "test_wheel.py::test_the_installed_wheel_generates_beside_transformers",  # CI 84 s
}


@functools.cache
def _module_starts_ray(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        return bool(_RAY_MODULE.search(f.read()))


def _starts_ray(item) -> bool:
    return "ray_local" in getattr(item, "fixturenames", ()) or _module_starts_ray(str(item.fspath))


def _is_slow(item) -> bool:
    base = os.path.basename(str(item.fspath))
    return f"{base}::{item.name}" in SLOW_TESTS or \
        f"{base}::{getattr(item, 'originalname', item.name)}" in SLOW_TESTS


def pytest_collection_modifyitems(items: list) -> None:
    """Marks `ray` and `slow` tests; then the slowest files first, tests keeping
    their order within a file (stable sort)."""
    for item in items:
        if _starts_ray(item):
            item.add_marker(pytest.mark.ray)
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
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
