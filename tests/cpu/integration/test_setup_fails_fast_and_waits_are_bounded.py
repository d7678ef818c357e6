"""A wedged engine fails instead of hanging, setup
mistakes fail at once with what to do, Ray is sized for the engine, and the
GPU-path start-up (KV profile, warm-up, block sizes, visible devices,
collective timeout) does what it says, checked here on CPU."""
from __future__ import annotations

import asyncio
import math
import os
import types

import msgspec
import pytest
import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.config import TRITON_BLOCK_SIZES, ConfigError, ParallelConfig, build_config
from conveyor.engine.frontend.async_client import AsyncLLM, collect
from conveyor.engine.frontend.async_client import EngineDeadError as FrontendDeadError
from conveyor.executors.base import EngineDeadError

SLOW_STEP = {"parallel.step_timeout_s": 2.0, "parallel.first_step_extra_s": 0.0}


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


# ---- every wait on a worker is bounded; a timeout is a dead rank ------------------

@pytest.fixture
def wedging_mp(monkeypatch):
    """executor "mp" whose output rank wedges on its 2nd forward (hang_worker.py)."""
    from conveyor import executors
    from conveyor.executors.multiproc import MultiprocExecutor

    def factory(config):
        ex = MultiprocExecutor(config)
        ex.worker_class = "hang_worker:HangWorker"
        return ex

    monkeypatch.setitem(executors.EXECUTORS, "mp", factory)


def test_wedged_rank_ends_requests_with_error_and_fails_health(wedging_mp, tmp_path):
    # No restarts: the fail-fast path (a rebuilt group would wedge again).
    cfg = build_config(model=str(tmp_path), executor="mp", tensor_parallel_size=2,
                       num_gpu_blocks=64, max_model_len=256, **SLOW_STEP,
                       **{"parallel.max_restarts": 0})

    async def scenario():
        llm = AsyncLLM(cfg)
        try:
            sp = SamplingParams(max_tokens=50, ignore_eos=True)
            # Without a bound this waits forever; wait_for only keeps a
            # regression from hanging the suite.
            outs = await asyncio.wait_for(asyncio.gather(
                *(collect(llm.generate([5, 6, 7], sp)) for _ in range(2))), 120)
            with pytest.raises(FrontendDeadError, match="wedged"):
                llm.check_health()
            with pytest.raises(EngineDeadError, match=r"parallel\.step_timeout_s"):
                llm.client.core.executor.check_health()
            return outs
        finally:
            await llm.shutdown()

    outs = asyncio.run(scenario())
    for o in outs:
        assert o.outputs[0].finish_reason == "error"
        assert len(o.outputs[0].token_ids) <= 1  # at most the one step before the wedge


def test_step_deadlines_cover_the_first_step_once(tmp_path):
    """The first forward step gets first_step_extra_s on top; later ones not."""
    from conveyor.executors.multiproc import MultiprocExecutor

    cfg = build_config(model=str(tmp_path), executor="mp", tensor_parallel_size=2,
                       **{"parallel.step_timeout_s": 5.0, "parallel.first_step_extra_s": 100.0})
    ex = MultiprocExecutor(cfg)
    try:
        import time
        t0 = time.monotonic()
        assert ex._step_deadline(forward=False) - t0 == pytest.approx(5.0, abs=1.0)
        assert ex._step_deadline(forward=True) - t0 == pytest.approx(105.0, abs=1.0)
        assert ex._step_deadline(forward=True) - t0 == pytest.approx(5.0, abs=1.0)
        assert ex._overdue_step() is None
        ex._deadlines[7] = t0 - 1.0
        assert "step 7 got no reply" in ex._overdue_step()
        with pytest.raises(EngineDeadError, match="step 7 got no reply"):
            ex.check_health()
    finally:
        ex.shutdown()


def test_uniproc_health_fails_on_an_overrunning_step(tmp_path):
    import time

    from conveyor.executors.uniproc import UniProcExecutor

    ex = UniProcExecutor(build_config(model=str(tmp_path), **SLOW_STEP))
    ex.check_health()
    ex._busy_since = time.monotonic() - 3.0  # a step started 3 s ago and still runs
    with pytest.raises(EngineDeadError, match="wedged"):
        ex.check_health()


class _SilentActor:
    class check_health:
        @staticmethod
        def remote() -> object:
            return object()

    wait_closed = check_health  # pending for the actor's life (never awaited here)


def test_health_check_timeout_is_unhealthy(monkeypatch):
    """A wedged engine actor fails health past the restart budget; within it
    the client replaces the actor, so health holds meanwhile."""
    import ray

    from conveyor.cluster.engine_actor.client import RayCoreClient
    from conveyor.cluster.engine_actor.link import CoreActorSpec, CoreLink
    from conveyor.engine.contracts import KVCacheInfo
    from conveyor.engine.core.recovery import RestartBudget

    def timeout(*_a, **_k):
        raise ray.exceptions.GetTimeoutError("timed out")

    idle = types.SimpleNamespace(try_send_payload=lambda _p: True, close=lambda: None)
    link = CoreLink(_SilentActor(), None, idle, idle, KVCacheInfo(8, 16))  # no output thread started
    client = RayCoreClient(CoreActorSpec(build_config()), link)
    client.budget = RestartBudget(0, 600.0)
    monkeypatch.setattr(ray, "get", timeout)
    try:
        with pytest.raises(EngineDeadError, match="did not answer a health check"):
            client.check_health()
        client.budget = RestartBudget(1, 600.0)
        assert client.check_health() == "recovering"
    finally:
        link.sender.close()


@pytest.mark.parametrize("key,value", [("parallel.step_timeout_s", 0.0),
                                       ("parallel.step_timeout_s", math.nan),
                                       ("parallel.collective_timeout_s", math.inf),
                                       ("parallel.placement_timeout_s", -1.0),
                                       ("parallel.num_cpus_per_worker", 0.0)])
def test_timeouts_are_validated_config_fields(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config(**{key: value})
    assert ParallelConfig().step_timeout_s >= 60  # generous by default


# ---- a missing model directory fails at once, saying what to do -------------------

MISSING = "/nonexistent/dir"
HINT = (f"model.path: directory {MISSING} not found (run `make run` to build demo_model, "
        "or point model.path at a Hugging Face checkpoint directory)")


def test_llm_with_a_missing_model_dir_says_what_to_do():
    with pytest.raises(ConfigError) as e:
        LLM(model=MISSING)
    assert HINT in str(e.value)
    with pytest.raises(ConfigError, match="model.path: directory"):
        AsyncLLM(build_config(model=MISSING))


def test_serve_config_with_a_missing_model_dir(tmp_path):
    import yaml

    from conveyor.cluster.serve_app import OpenAIDeployment, build_app

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": MISSING}}))
    with pytest.raises(ConfigError) as e:
        build_app({"config": str(path)})
    assert HINT in str(e.value) and str(path) in str(e.value)
    # A replica whose __init__ failed: Serve still calls __del__, which must not
    # raise AttributeError about the parts that were never built.
    user_cls = OpenAIDeployment.__mro__[1]
    # (a subclass whose own finalizer is sync, so garbage collection of the
    # test object does not leave an un-awaited coroutine behind)
    half = object.__new__(type("Half", (user_cls,), {"__del__": lambda self: None}))
    with pytest.raises(ConfigError, match="model.path: directory"):
        user_cls.__init__(half, str(path), {}, False)
    asyncio.run(user_cls.__del__(half))


# ---- Ray is sized for the engine; a cluster without room fails fast --------------

def test_library_started_ray_fits_the_requested_world(monkeypatch):
    import conveyor.executors.ray_executor as rx

    calls = []
    monkeypatch.setattr(rx.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(rx.ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(rx.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = build_config(executor="ray", tensor_parallel_size=2, pipeline_parallel_size=2)
    assert rx.ensure_ray(cfg) is True
    assert calls == [{"address": "local", "num_cpus": 4, "include_dashboard": False}]


def test_local_ray_num_cpus():
    from conveyor.executors.ray_placement import local_ray_num_cpus

    world4 = build_config(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert local_ray_num_cpus(world4, cpu_count=2) == 4
    assert local_ray_num_cpus(world4, cpu_count=16) == 16
    half = build_config(tensor_parallel_size=4, **{"parallel.num_cpus_per_worker": 0.5})
    assert local_ray_num_cpus(half, cpu_count=1) == 2
    assert local_ray_num_cpus(None, cpu_count=3) == 3


def test_placement_error_names_what_is_missing_and_available():
    from conveyor.executors.ray_placement import missing_resources, placement_error

    bundles = [{"CPU": 1.0}] * 4
    avail = {"CPU": 2.0, "memory": 1e9, "node:127.0.0.1": 1.0, "object_store_memory": 1e8}
    assert missing_resources(bundles, avail) == {"CPU": 2.0}
    assert missing_resources([{"CPU": 0.5}] * 4, avail) == {}
    msg = placement_error(bundles, "PACK", 10.0, avail)
    assert "4 x {'CPU': 1.0} (PACK) not ready after 10s" in msg
    assert "missing 2 CPU; available: {'CPU': 2.0}" in msg
    gpu = placement_error([{"GPU": 1.0}] * 8, "PACK", 10.0, {"CPU": 8.0, "GPU": 4.0})
    assert "missing 4 GPU; available: {'CPU': 8.0, 'GPU': 4.0}" in gpu


def test_placement_on_a_full_cluster_fails_fast(tmp_path):
    """An existing 2-CPU cluster, a 4-rank engine: the error comes after
    parallel.placement_timeout_s (default <= 10 s) and names the shortage; half
    a core per rank fits the same cluster."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from conveyor.executors.ray_executor import RayExecutor

    assert ParallelConfig().placement_timeout_s <= 10.0
    shape = dict(model=str(tmp_path), executor="ray", tensor_parallel_size=2, pipeline_parallel_size=2)
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        ex = RayExecutor(build_config(**shape, **{"parallel.placement_timeout_s": 1.0}))
        try:
            with pytest.raises(RuntimeError, match=r"missing 2 CPU; available: \{'CPU': 2\.0\}"):
                ex._placement_group()
        finally:
            ex.shutdown()
        ex = RayExecutor(build_config(**shape, **{"parallel.num_cpus_per_worker": 0.5}))
        try:
            pg, first = ex._placement_group()
            assert first == 0 and pg.bundle_specs == [{"CPU": 0.5}] * 4
            remove_placement_group(pg)
        finally:
            ex.shutdown()
    finally:
        ray.shutdown()


# ---- profile, warm-up, block sizes, visible devices, collective timeout ---------

def _stage_runner(path: str, monkeypatch, rank: int, size: int, cfg):
    from conveyor.parallel import state
    from conveyor.workers.model_loader import load_hf_config, load_model
    from conveyor.workers.model_runner import ModelRunner

    monkeypatch.setattr(state, "pp_rank", lambda: rank)
    monkeypatch.setattr(state, "pp_size", lambda: size)
    monkeypatch.setattr(state, "is_first_pp_rank", lambda: rank == 0)
    monkeypatch.setattr(state, "is_last_pp_rank", lambda: rank == size - 1)
    hf = load_hf_config(path)
    model = load_model(path, hf, torch.float32, torch.device("cpu"))
    return ModelRunner(cfg, model, torch.device("cpu"), hf.vocab_size, rank == size - 1, rank == 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_profile_runs_real_attention_logits_and_sampler_on_every_stage(ckpt, monkeypatch, rank):
    from conveyor.workers.layers.attention import Attention, find_attention_layers

    cfg = build_config(model=ckpt, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    runner = _stage_runner(ckpt, monkeypatch, rank, 2, cfg)

    def no_fallback(*_a):
        raise AssertionError("the profile took the [H, T, T] SDPA fallback")

    monkeypatch.setattr(Attention, "_causal", no_fallback)
    attn_tokens, sampled = [], []
    fwd, sampler = runner.attn_backend.forward, runner.sampler
    monkeypatch.setattr(runner.attn_backend, "forward",
                        lambda q, cache, meta, scale: attn_tokens.append(q.shape[0]) or fwd(q, cache, meta, scale))
    runner.sampler = lambda logits, meta: sampled.append(tuple(logits.shape)) or sampler(logits, meta)

    cache_bytes = runner.profile_run(torch.float32)
    layers = find_attention_layers(runner.model)
    assert attn_tokens == [64] * len(layers) and len(layers) == 1  # one of the 2 layers per stage
    assert sampled == ([(4, 512)] if rank == 1 else [])  # max_num_seqs rows x vocab
    assert cache_bytes == (4 + 1) * runner.kv_bytes_per_block(torch.float32)
    # Nothing of the profile stays behind.
    assert runner.kv_caches == [] and all(a.kv_cache is None for a in layers)
    assert runner.requests == {} and runner.input_batch.num_reqs == 0


def test_dummy_shapes_fit_the_runner():
    from conveyor.workers.dummy_batch import DummyShape, profile_shape, warmup_shapes

    assert profile_shape(2048, 256, 4096) == DummyShape(256, 8, 8)
    # one sequence at the model's length leaves room for the token it samples
    assert profile_shape(64, 1, 32) == DummyShape(1, 31, 31)
    assert warmup_shapes(16, 256, 256) == [DummyShape(2, 17, 17), DummyShape(2, 255, 1)]
    assert warmup_shapes(16, 8, 1) == [DummyShape(1, 7, 7), DummyShape(1, 7, 1)]


def test_warm_up_compiles_the_triton_kernels_before_ready(ckpt, monkeypatch):
    from conveyor.kernels.paged_attention import TritonAttentionBackend
    from conveyor.workers.worker import Worker

    query_lens = []
    fwd = TritonAttentionBackend.forward
    monkeypatch.setattr(TritonAttentionBackend, "forward",
                        lambda self, q, cache, meta, scale: query_lens.append(meta.max_query_len)
                        or fwd(self, q, cache, meta, scale))
    cfg = build_config(model=ckpt, attention_backend="triton", max_model_len=512,
                       num_gpu_blocks=80, max_num_batched_tokens=64)
    w = Worker(cfg)
    try:
        w.init_device()
        w.load_model()
        assert query_lens == []
        w.initialize_cache(w.determine_num_blocks())
        assert query_lens == [17, 17, 1, 1]  # a prefill and a decode-only batch, 2 layers each
        runner = w.model_runner
        assert all(not c.any() for c in runner.kv_caches)  # zeroed again
        assert runner.requests == {} and runner.input_batch.num_reqs == 0
    finally:
        w.shutdown()


@pytest.mark.parametrize("backend,block,ok", [("triton", 8, False), ("auto", 128, False),
                                              ("triton", 32, True), ("torch", 8, True),
                                              ("torch", 128, True)])
def test_block_sizes_the_triton_kernels_cannot_run_fail_at_load(backend, block, ok):
    kw = {"attention_backend": backend, "block_size": block}
    if ok:
        assert build_config(**kw).cache.block_size == block
    else:
        with pytest.raises(ConfigError, match=r"cache\.block_size: expected one of 16/32/64 with "
                                              rf"model\.attention_backend '{backend}'.*got {block}"):
            build_config(**kw)


def test_config_and_kernels_agree_on_triton_block_sizes():
    from conveyor.kernels.paged_attention import SUPPORTED_BLOCK_SIZES

    assert TRITON_BLOCK_SIZES == SUPPORTED_BLOCK_SIZES


def test_tp_ranks_see_their_nodes_gpus_in_bundle_order():
    from conveyor.executors.ray_placement import visible_devices

    got = visible_devices(["A", "A", "B", "B"], [["3"], ["1"], ["0"], ["2"]])
    assert got == [("3,1", 0), ("3,1", 1), ("0,2", 0), ("0,2", 1)]
    with pytest.raises(RuntimeError, match="same GPU"):
        visible_devices(["A", "A"], [["0"], ["0"]])


def test_each_rank_gets_its_devices():
    """On GPU every rank sees its node's ranks' GPUs and its local rank is its
    own GPU's place there; on CPU the local rank counts the node's earlier ranks."""
    from conveyor.executors.ray_placement import rank_devices

    nodes = ["A", "A", "B", "B"]  # the ranks' nodes, in rank order
    assert rank_devices(nodes, [["5"], ["4"], ["1"], ["0"]]) == (
        [0, 1, 0, 1], [{"CUDA_VISIBLE_DEVICES": "5,4"}] * 2 + [{"CUDA_VISIBLE_DEVICES": "1,0"}] * 2)
    assert rank_devices(nodes, None) == ([0, 1, 0, 1], [{}] * 4)


def test_worker_actor_sets_its_env_before_the_worker_starts(monkeypatch):
    import conveyor.executors.worker_proc as wp
    from conveyor.executors.channel import PlaneKeys
    from conveyor.executors.ray_worker import RayWorkerActor

    seen = []
    monkeypatch.setattr(wp, "run_worker_loop",
                        lambda config, spec: seen.append(os.environ.get("CUDA_VISIBLE_DEVICES")))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spec = wp.WorkerSpec(0, 0, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3",
                         PlaneKeys.generate().for_clients())
    RayWorkerActor.__ray_actor_class__.run(None, msgspec.msgpack.encode(build_config()),
                                           msgspec.msgpack.encode(spec), {"CUDA_VISIBLE_DEVICES": "5,4"})
    assert seen == ["5,4"]


def test_collective_timeout_is_a_config_field(monkeypatch, tmp_path):
    from conveyor.workers import worker as worker_mod

    got = {}
    monkeypatch.setattr(worker_mod.ps, "init_distributed", lambda *a, **kw: got.update(kw))
    cfg = build_config(model=str(tmp_path), **{"parallel.collective_timeout_s": 42.0})
    worker_mod.Worker(cfg).init_device()
    assert got == {"timeout_s": 42.0}


# ---- the parity rule the TP/PP tests use can fail ---------------------------------

def test_parity_rule_compares_lengths_and_both_top5s():
    from llm_utils import close_or_why

    top = [{1, 2, 3, 4, 5}] * 3
    assert close_or_why([1, 2, 3], top, [1, 2, 3], top) is None
    assert "lengths differ: 2 vs 3" in close_or_why([1, 2], top, [1, 2, 3], top)
    # diverging at 1: 4 is in the reference's top-5 and 2 in ours -> close
    assert close_or_why([1, 4, 9], top, [1, 2, 3], top) is None
    # 9 is outside the reference's top-5
    assert "first divergence at 1" in close_or_why([1, 9, 3], top, [1, 2, 3], top)
    # the reference's token is outside our top-5
    ours = [{1, 2, 3, 4, 5}, {4, 6, 7, 8, 0}, {3}]
    assert "first divergence at 1" in close_or_why([1, 4, 3], ours, [1, 2, 3], top)


# ---- setup mistakes are one line and exit code 2, before any deploy ------

def _cli(capsys, *argv: str) -> tuple[int, str]:
    from conveyor.cluster.cli.main import main

    rc = main(list(argv))
    err = capsys.readouterr().err.strip()
    return rc, err


def _yaml(tmp_path, name: str, tree: dict) -> str:
    import json

    path = tmp_path / name
    path.write_text(json.dumps(tree))  # JSON is YAML
    return str(path)


def test_serve_setup_mistakes_fail_before_deploying(ckpt, tmp_path, capsys, monkeypatch):
    import socket

    monkeypatch.delenv("CONVEYOR_TEST_UNSET_KEY", raising=False)
    cfg = _yaml(tmp_path, "key.yaml", {"model": {"path": ckpt},
                                      "serve": {"api_key_env": "CONVEYOR_TEST_UNSET_KEY"}})
    rc, err = _cli(capsys, "serve", cfg)
    assert rc == 2 and err.count("\n") == 0, err
    assert "CONVEYOR_TEST_UNSET_KEY" in err and "export" in err, err
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        cfg = _yaml(tmp_path, "port.yaml", {"model": {"path": ckpt},
                                           "serve": {"host": "127.0.0.1", "port": port}})
        rc, err = _cli(capsys, "serve", cfg)
    assert rc == 2 and err.count("\n") == 0 and f"serve.port {port}" in err and "in use" in err, err
    import ray

    assert not ray.is_initialized()  # refused before Ray started


def test_generate_on_a_broken_checkpoint_is_one_line(ckpt, tmp_path, capsys):
    import json
    import shutil

    def broken(name: str, damage) -> str:
        d = tmp_path / name
        shutil.copytree(ckpt, d)
        damage(d)
        return _yaml(tmp_path, f"{name}.yaml", {"model": {"path": str(d)}})

    def truncate(d) -> None:
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    def vocab(d) -> None:
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, "vocab_size": -5}))

    cases = {"truncated": (truncate, "truncated"),
             "garbage": (lambda d: (d / "model.safetensors").write_bytes(os.urandom(4096)),
                         "not a complete safetensors file"),
             "noweights": (lambda d: (d / "model.safetensors").unlink(), "no *.safetensors weights"),
             "vocab": (vocab, "vocab_size must be a positive integer, got -5")}
    for name, (damage, message) in cases.items():
        rc, err = _cli(capsys, "generate", broken(name, damage), "--prompt", "hi")
        assert rc == 2 and err.count("\n") == 0 and message in err, (name, err)
        assert "[rank0]" not in err and "Traceback" not in err


def test_config_validate_refuses_an_empty_file(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    from conveyor.cluster.cli.main import main

    assert main(["config", "validate", str(empty)]) == 1
    assert "the file is empty" in capsys.readouterr().out
