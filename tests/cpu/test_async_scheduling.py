"""Async scheduling end to end (engine/async_scheduling.py): with the next step
planned while one runs, an LLM gives the tokens of the synchronous loop —
greedy and seeded, under chunked prefill and preemption, with stop strings and
stop ids, structured outputs and n-gram drafts. Two engines (async on / off)
share one config that chunks (budget 64) and preempts (17 KV blocks)."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from llm_utils import make_checkpoint, random_prompts
from recovery_utils import greedy_and_seeded
from structured_schemas import CHOICES, REGEXES

PROMPTS = random_prompts(8, 30, 90, seed=61)
PARAMS = greedy_and_seeded(8, max_tokens=32, temperature=1.0, seed=70)
CFG = dict(max_num_batched_tokens=64, num_gpu_blocks=17, max_model_len=256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("async") / "llama"))


@pytest.fixture(scope="module")
def engines(ckpt):
    on, off = LLM(model=ckpt, async_scheduling="on", **CFG), LLM(model=ckpt, async_scheduling="off", **CFG)
    try:
        assert on.engine.async_scheduling and not off.engine.async_scheduling
        yield on, off
    finally:
        on.shutdown()
        off.shutdown()


def _tokens(llm: LLM, prompts, params) -> list[tuple[list[int], str | None, str]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_seeded_chunked_preempted(engines):
    on, off = engines
    ref = _tokens(off, PROMPTS, PARAMS)
    assert off.engine.scheduler.num_preemptions > 0
    assert _tokens(on, PROMPTS, PARAMS) == ref
    assert on.engine.scheduler.num_preemptions > 0
    assert all(r == "length" for _, r, _ in ref)
    sched = on.engine.scheduler
    assert not sched.requests and sched.kv_cache_manager.get_num_free_blocks() == 16


def test_stops_and_max_tokens(engines):
    """A request that stops in step N was already planned into N+1: that
    token is dropped, and stop strings, stop ids and caps end where sync does."""
    on, off = engines
    full = _tokens(off, PROMPTS[:2], PARAMS[:1] * 2)
    stop_str = full[0][2][3:6]
    stop_id = full[1][0][4]
    params = [PARAMS[0].clone(stop=[stop_str]), PARAMS[0].clone(stop_token_ids=[stop_id]),
              PARAMS[0].clone(max_tokens=1), PARAMS[-1].clone(max_tokens=3, stop=[stop_str])]
    ref = _tokens(off, PROMPTS[:4], params)
    assert ref[0][1] == ref[1][1] == "stop" and ref[2][1] == "length"
    assert _tokens(on, PROMPTS[:4], params) == ref
    assert not on.engine.has_work()


def test_structured_outputs(engines):
    """A running structured request makes the core finish the step in flight
    before planning the next (its mask needs the latest token)."""
    on, off = engines
    so = [StructuredOutputsParams(regex=REGEXES[3]), StructuredOutputsParams(choice=CHOICES[1])]
    params = [PARAMS[0].clone(structured_outputs=s) for s in so] + PARAMS[4:6]
    ref = _tokens(off, PROMPTS[:4], params)
    assert _tokens(on, PROMPTS[:4], params) == ref
    assert ref[1][2] in CHOICES[1]


def test_ngram_drafts(ckpt, engines):
    """Speculation needs the latest token for its drafts: async steps aside
    while requests run, and greedy tokens equal the non-speculative engine's."""
    _, off = engines
    ref = _tokens(off, PROMPTS[:4], PARAMS[:4])
    llm = LLM(model=ckpt, async_scheduling="on", speculative_config={"method": "ngram"}, **CFG)
    try:
        assert _tokens(llm, PROMPTS[:4], PARAMS[:4]) == ref
    finally:
        llm.shutdown()
