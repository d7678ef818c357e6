"""The Ray path: EngineCoreActor + RayExecutor on one module-scoped local Ray
instance. Parity with uniproc, failure handling and PP overlap
(data-plane security: test_data_plane_security.py)."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
from llm_utils import close_or_why, engine_top5, make_checkpoint, random_prompts, wait_pids_gone
from probe_workers import use_worker_class
from recovery_utils import drain_all, expect_fail_fast

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.config import build_config
from conveyor.engine.frontend.async_client import AsyncLLM

# logprobs=5: parity is vLLM's rule, which needs both sides' top-5.
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)


def _ids_and_top5(llm, prompts):
    outs = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return [(o.token_ids, engine_top5(o)) for o in outs]


def _assert_close(got, ref, what: str) -> None:
    assert len(got) == len(ref)
    for i, ((g, g5), (r, r5)) in enumerate(zip(got, ref)):
        why = close_or_why(g, g5, r, r5)
        assert why is None, f"{what}, prompt {i}: {why}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("qwen2", str(tmp_path_factory.mktemp("ray") / "m"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 1, 100, seed=21)


PROMPT_LP = SamplingParams(max_tokens=1, prompt_logprobs=2)


@pytest.fixture(scope="module")
def reference(ckpt, prompts):
    llm = LLM(model=ckpt, max_num_batched_tokens=64)
    try:
        plp = [o.prompt_logprobs for o in llm.generate(prompts[:2], PROMPT_LP, use_tqdm=False)]
        return _ids_and_top5(llm, prompts), plp
    finally:
        llm.shutdown()


# TP x PP; TP alone under Ray runs in test_worker_death_mid_stream_is_recovered,
# PP alone (the batch queue over Ray) in test_structured_outputs' Ray tests.
@pytest.mark.parametrize("tp,pp", [(2, 2)])
def test_ray_parity_with_uniproc(ray_local, ckpt, prompts, reference, tp, pp):
    llm = LLM(model=ckpt, executor="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              max_num_batched_tokens=64)
    try:
        got = _ids_and_top5(llm, prompts)
        # prompt logprobs through the Ray workers' output rank equal uniproc's
        plp = [o.prompt_logprobs for o in llm.generate(prompts[:2], PROMPT_LP, use_tqdm=False)]
    finally:
        llm.shutdown()
    _assert_close(got, reference[0], f"tp={tp} pp={pp}")
    for g, r in zip(plp, reference[1]):
        assert g[0] is None and len(g) == len(r)
        for dg, dr in zip(g[1:], r[1:]):
            assert dg.keys() == dr.keys() and all(abs(dg[t] - dr[t]) < 1e-4 for t in dr)


def test_worker_death_mid_stream_is_recovered(ray_local, ckpt, prompts):
    """Streams in flight when a rank dies finish as if nothing happened."""
    cfg = build_config(model=ckpt, executor="ray", tensor_parallel_size=2)
    sp = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)

    async def scenario():
        llm = AsyncLLM(cfg)
        streams = [llm.generate(p, sp) for p in prompts[:4]]
        firsts = [await s.__anext__() for s in streams]
        before = llm.worker_pids()
        os.kill(before[1], signal.SIGKILL)
        outs = await drain_all(firsts, streams, timeout_s=120)
        llm.check_health()
        after = llm.worker_pids()
        await llm.shutdown()
        return outs, before, after

    outs, before, after = asyncio.run(scenario())
    assert len(after) == 2 and not set(after) & set(before)
    ref = LLM(config=cfg)  # an undisturbed run of the same engine shape
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts[:4], sp, use_tqdm=False)]
    finally:
        ref.shutdown()
    assert [r for _, r in outs] == ["length"] * 4
    assert [t for t, _ in outs] == want


def test_worker_death_past_restart_budget_fails_requests_and_engine(ray_local, ckpt, prompts):
    cfg = build_config(model=ckpt, executor="ray", tensor_parallel_size=2,
                       **{"parallel.max_restarts": 0})

    async def scenario():
        llm = AsyncLLM(cfg)
        sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        streams = [llm.generate(p, sp) for p in prompts[:4]]
        firsts = [await s.__anext__() for s in streams]  # every request is generating
        pids = llm.client.worker_pids()
        os.kill(pids[1], signal.SIGKILL)
        try:
            await expect_fail_fast(llm, firsts, streams, sp.max_tokens)  # the issue: within 30 s
        finally:
            await llm.shutdown()
        return pids

    pids = asyncio.run(scenario())
    assert wait_pids_gone(pids, timeout_s=30) == [], "worker processes left behind"
    # A new engine starts fine afterwards.
    llm = LLM(model=ckpt, executor="ray")
    try:
        assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_pp_batch_queue_overlaps(ckpt, prompts, monkeypatch):
    """Two batches in flight at once: stage 0 runs step k+1 while stage 1 still
    runs step k; outputs equal the PP=1 run."""
    use_worker_class(monkeypatch, "probe_workers:TimedWorker")  # adds the step_timeline RPC
    llm = LLM(model=ckpt, executor="mp", pipeline_parallel_size=2, max_num_batched_tokens=64,
              max_num_seqs=8)
    try:
        assert llm.engine.batch_queue_size == 2
        got = _ids_and_top5(llm, prompts)
        flat = llm.engine.executor.collective_rpc("step_timeline")
    finally:
        llm.shutdown()
    ref_llm = LLM(model=ckpt, max_num_batched_tokens=64, max_num_seqs=8)
    try:
        ref = _ids_and_top5(ref_llm, prompts)
    finally:
        ref_llm.shutdown()
    _assert_close(got, ref, "pp=2 batch queue")
    s0 = {int(flat[0][i]): (flat[0][i + 1], flat[0][i + 2]) for i in range(0, len(flat[0]), 3)}
    s1 = {int(flat[1][i]): (flat[1][i + 1], flat[1][i + 2]) for i in range(0, len(flat[1]), 3)}
    steps = sorted(s1)
    overlaps = sum(1 for a, b in zip(steps, steps[1:]) if b in s0 and s0[b][0] < s1[a][1])
    assert overlaps > 0, "stage 0 never started a new batch while stage 1 was busy"

