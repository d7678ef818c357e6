"""The Ray path: EngineCoreActor + RayExecutor on one module-scoped local Ray
instance. Parity with uniproc, failure handling and PP overlap
(data-plane security: test_data_plane_security.py)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from engine import LLM, SamplingParams
from engine.async_client import AsyncLLM, collect
from engine.config import build_config
from llm_utils import pid_alive, make_checkpoint, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("qwen2", str(tmp_path_factory.mktemp("ray") / "m"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 1, 100, seed=21)


@pytest.fixture(scope="module")
def reference(ckpt, prompts):
    llm = LLM(model=ckpt, max_num_batched_tokens=64)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_ray_parity_with_uniproc(ray_local, ckpt, prompts, reference, tp, pp):
    llm = LLM(model=ckpt, executor="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              max_num_batched_tokens=64)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert sum(g == r for g, r in zip(got, reference)) >= len(prompts) - 1


def test_worker_death_fails_requests_and_engine(ray_local, ckpt, prompts):
    cfg = build_config(model=ckpt, executor="ray", tensor_parallel_size=2)

    async def scenario():
        llm = AsyncLLM(cfg)
        sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        tasks = [asyncio.create_task(collect(llm.generate(p, sp))) for p in prompts[:4]]
        await asyncio.sleep(1.0)  # generating
        pids = llm.client.worker_pids()
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        elapsed = time.monotonic() - t0
        with pytest.raises(Exception):
            llm.check_health()
        with pytest.raises(Exception):
            llm.prepare([1, 2, 3], SamplingParams(max_tokens=2))  # new requests refused
        await llm.shutdown()
        return outs, elapsed, pids

    outs, elapsed, pids = asyncio.run(scenario())
    assert elapsed < 30
    for o in outs:
        assert o.outputs[0].finish_reason == "error"
        assert len(o.outputs[0].token_ids) < 400
    time.sleep(1.0)
    for pid in pids:
        assert not pid_alive(pid), f"worker process {pid} left behind"
    # A new engine starts fine afterwards.
    llm = LLM(model=ckpt, executor="ray")
    try:
        assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_pp_batch_queue_overlaps(ckpt, prompts):
    """Two batches in flight at once: stage 0 runs step k+1 while stage 1 still
    runs step k; outputs equal the PP=1 run."""
    llm = LLM(model=ckpt, executor="mp", pipeline_parallel_size=2, max_num_batched_tokens=64,
              max_num_seqs=8)
    try:
        assert llm.engine.batch_queue_size == 2
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        flat = llm.engine.executor.collective_rpc("step_timeline")
    finally:
        llm.shutdown()
    ref_llm = LLM(model=ckpt, max_num_batched_tokens=64, max_num_seqs=8)
    try:
        ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        ref_llm.shutdown()
    assert sum(g == r for g, r in zip(got, ref)) >= len(prompts) - 1
    s0 = {int(flat[0][i]): (flat[0][i + 1], flat[0][i + 2]) for i in range(0, len(flat[0]), 3)}
    s1 = {int(flat[1][i]): (flat[1][i + 1], flat[1][i + 2]) for i in range(0, len(flat[1]), 3)}
    steps = sorted(s1)
    overlaps = sum(1 for a, b in zip(steps, steps[1:]) if b in s0 and s0[b][0] < s1[a][1])
    assert overlaps > 0, "stage 0 never started a new batch while stage 1 was busy"

