"""Async scheduling end to end (conveyor/engine/core/async_scheduling.py): with the next step
planned while one runs, an LLM gives the tokens of the synchronous loop —
greedy and seeded, under chunked prefill and preemption, with stop strings and
stop ids, structured outputs and n-gram drafts. Two engines (async on / off)
share one config that chunks (budget 64) and preempts (17 KV blocks)."""
from __future__ import annotations

import pytest
from llm_utils import random_prompts
from recovery_utils import greedy_and_seeded
from structured_schemas import CHOICES, REGEXES

from conveyor.engine import LLM, StructuredOutputsParams

PROMPTS = random_prompts(8, 30, 90, seed=61)
PARAMS = greedy_and_seeded(8, max_tokens=32, temperature=1.0, seed=70)
CFG = dict(max_num_batched_tokens=64, num_gpu_blocks=17, max_model_len=256)


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


def _tokens(llm: LLM, prompts, params) -> list[tuple[list[int], str | None, str]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _cases(full_text: str, stop_id: int) -> dict[str, tuple[list, list]]:
    """name -> (prompts, params). Stops: a request that stops in step N was
    already planned into N+1, whose token for it is dropped. Structured: a
    running structured request makes the core finish the step in flight before
    it plans the next (its mask needs the latest token)."""
    stop_str = full_text[3:6]
    stops = [PARAMS[0].clone(stop=[stop_str]), PARAMS[0].clone(stop_token_ids=[stop_id]),
             PARAMS[0].clone(max_tokens=1), PARAMS[-1].clone(max_tokens=3, stop=[stop_str])]
    so = [StructuredOutputsParams(regex=REGEXES[3]), StructuredOutputsParams(choice=CHOICES[1])]
    structured = [PARAMS[0].clone(structured_outputs=s) for s in so] + PARAMS[4:6]
    return {"mix": (PROMPTS, PARAMS), "stops": (PROMPTS[:4], stops),
            "structured": (PROMPTS[:4], structured)}


@pytest.fixture(scope="module")
def runs(ckpt):
    """Every case through async off, then on (one engine per process at a time)."""
    out: dict[str, dict] = {"off": {}, "on": {}}
    cases = None
    for mode in ("off", "on"):
        llm = LLM(model=ckpt, async_scheduling=mode, **CFG)
        try:
            assert llm.engine.async_scheduling == (mode == "on")
            if cases is None:
                full = _tokens(llm, PROMPTS[:2], PARAMS[:1] * 2)
                cases = _cases(full[0][2], full[1][0][4])
            for name, (prompts, params) in cases.items():
                out[mode][name] = _tokens(llm, prompts, params)
            out[mode]["preemptions"] = llm.engine.scheduler.num_preemptions
            sched = llm.engine.scheduler
            assert not sched.requests and sched.kv_cache_manager.get_num_free_blocks() == 16
            # At most the step planned past the last finish is still in flight; it drains.
            assert len(llm.engine.batch_queue or ()) <= 1
            for _ in range(2):
                llm.engine.step_fn()
            assert not llm.engine.has_work()
        finally:
            llm.shutdown()
    return out


def test_greedy_seeded_chunked_preempted(runs):
    assert runs["on"]["mix"] == runs["off"]["mix"]
    assert runs["on"]["preemptions"] > 0 and runs["off"]["preemptions"] > 0
    assert all(r == "length" for _, r, _ in runs["off"]["mix"])


def test_stops_and_max_tokens(runs):
    ref = runs["off"]["stops"]
    assert ref[0][1] == ref[1][1] == "stop" and ref[2][1] == "length" and len(ref[2][0]) == 1
    assert runs["on"]["stops"] == ref


def test_structured_outputs(runs):
    ref = runs["off"]["structured"]
    assert runs["on"]["structured"] == ref
    assert ref[1][2] in CHOICES[1]


def test_ngram_drafts(ckpt, runs):
    """Speculation needs the latest token for its drafts: async steps aside
    while requests run, and greedy tokens equal the non-speculative engine's."""
    llm = LLM(model=ckpt, async_scheduling="on", speculative_config={"method": "ngram"}, **CFG)
    try:
        assert _tokens(llm, PROMPTS[:4], PARAMS[:4]) == runs["off"]["mix"][:4]
    finally:
        llm.shutdown()
