"""End to end with LLM on CUDA (tests/gpu/run.sh): fp32 token-equal to
transformers with the triton and torch backends, chunked prefill and prefix
caching; bf16 under vLLM's top-5 rule; async scheduling and decode CUDA graphs
on and off give identical tokens; executor "ray" with one GPU worker.

Skipped unless CUDA is present. The transformers reference runs on the CPU in
fp32 (the checkpoints are tiny)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("end-to-end GPU tests need CUDA (and TRITON_INTERPRET unset)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for p in (ROOT, os.path.join(ROOT, "tests", "cpu")):
    if p not in sys.path:
        sys.path.insert(0, p)

from conveyor.engine import LLM, SamplingParams  # noqa: E402
from llm_utils import (close_or_why, engine_top5, hf_greedy, hf_top5, make_checkpoint,  # noqa: E402
                       random_prompts)

torch.backends.cuda.matmul.allow_tf32 = False
PROMPTS = random_prompts(8, 1, 300, seed=1)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=32, temperature=1.0, seed=50 + i, ignore_eos=True) for i in range(4)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("gpu") / "llama"))


@pytest.fixture(scope="module")
def refs(ckpt):
    return hf_greedy(ckpt, PROMPTS, 32)


def _generate(ckpt: str, prompts, params, **kw) -> tuple[list, LLM]:
    llm = LLM(model=ckpt, **kw)
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm
    finally:
        llm.shutdown()


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("extra", [{}, {"max_num_batched_tokens": 64}], ids=["whole", "chunked"])
def test_fp32_token_equal_to_hf(ckpt, refs, backend, extra):
    outs, _ = _generate(ckpt, PROMPTS, GREEDY, dtype="float32", attention_backend=backend, **extra)
    assert _ids(outs) == refs


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_prefix_caching_fp32(ckpt, backend):
    prefix = random_prompts(1, 64, 64, seed=7)[0]
    shared = random_prompts(6, 1, 40, seed=8, prefix=prefix)
    ref = hf_greedy(ckpt, shared, 32)
    outs, llm = _generate(ckpt, shared, GREEDY, dtype="float32", attention_backend=backend,
                          enable_prefix_caching=True)
    assert _ids(outs) == ref
    assert all(o.num_cached_tokens >= 64 for o in outs[1:])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bf16_top5_rule(ckpt, refs, backend):
    outs, _ = _generate(ckpt, PROMPTS, GREEDY.clone(logprobs=5), dtype="bfloat16",
                        attention_backend=backend)
    bad = []
    for p, o, ref in zip(PROMPTS, outs, refs):
        ours = o.outputs[0].token_ids
        why = close_or_why(ours, engine_top5(o.outputs[0]), ref, hf_top5(ckpt, p, ref))
        if why:
            bad.append(why)
    assert not bad, bad


def _runner(llm: LLM):
    return llm.engine.executor.worker.model_runner


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_scheduling_and_cuda_graphs_same_tokens(ckpt, dtype):
    """Greedy + seeded, under chunking: async on/off x graphs on/off agree."""
    params = [GREEDY] * 4 + SEEDED
    got = {}
    for async_ in ("off", "on"):
        for eager in (True, False):
            llm = LLM(model=ckpt, dtype=dtype, async_scheduling=async_, enforce_eager=eager,
                      max_num_batched_tokens=128, max_num_seqs=32)
            try:
                assert llm.engine.async_scheduling == (async_ == "on")
                assert (_runner(llm).graphs is None) == eager
                got[(async_, eager)] = _ids(llm.generate(PROMPTS, params, use_tqdm=False))
            finally:
                llm.shutdown()
    base = got[("off", True)]
    assert all(v == base for v in got.values()), {k: v == base for k, v in got.items()}


def test_auto_is_async_with_graphs_on_cuda(ckpt):
    llm = LLM(model=ckpt, max_num_seqs=20)
    try:
        assert llm.engine.async_scheduling
        assert _runner(llm).graphs.sizes == [1, 2, 4, 8, 16]
    finally:
        llm.shutdown()


def test_ray_executor_one_gpu_worker(ckpt, refs):
    pytest.importorskip("ray")
    outs, _ = _generate(ckpt, PROMPTS, GREEDY, dtype="float32", executor="ray")
    assert _ids(outs) == refs
