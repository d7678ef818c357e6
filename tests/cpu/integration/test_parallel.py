"""Tensor and pipeline parallelism over gloo in spawned worker processes
(executor "mp", no Ray): token parity with TP=1 and transformers, sharded
weights, uneven splits, and a failing rank."""
from __future__ import annotations

import pytest
from llm_utils import (
    close_or_why,
    engine_top5,
    hf_greedy,
    hf_logprobs,
    hf_top5,
    make_checkpoint,
    random_prompts,
    wait_pids_gone,
)
from probe_workers import use_worker_class
from tiny_models import make_tiny_model

from conveyor.engine import LLM, SamplingParams
from conveyor.executors.base import EngineDeadError

# logprobs=5: vLLM's parity rule needs our top-5 at the first divergence;
# prompt_logprobs=2: the prompt's logprobs come back from the output rank.
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=2)


def _assert_close_to_hf(path, prompts, got, ref, what: str) -> None:
    """got: CompletionOutputs; ref: transformers' greedy token ids."""
    assert len(got) == len(ref) == len(prompts)
    for i, (p, g, r) in enumerate(zip(prompts, got, ref)):
        why = close_or_why(g.token_ids, engine_top5(g), r, hf_top5(path, p, r))
        assert why is None, f"{what}, prompt {i}: {why}"
# TP x PP splits every weight both ways and sends activations between stages:
# TP alone runs in test_replicated_kv_heads_and_odd_vocab (TP=4), PP alone in
# test_ray_executor's batch-queue test.
LAYOUTS = [(2, 2)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("par")
    return {f: make_checkpoint(f, str(base / f), num_hidden_layers=4) for f in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, 1, 120, seed=11)


def _run(path, prompts, tp, pp, **kw):
    llm = LLM(model=path, executor="mp" if tp * pp > 1 else "uniproc", tensor_parallel_size=tp,
              pipeline_parallel_size=pp, max_num_batched_tokens=64, enable_prefix_caching=True, **kw)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for o in outs:  # the prompt's logprobs ride along on the first output
        o.outputs[0].prompt_logprobs = o.prompt_logprobs
    return [o.outputs[0] for o in outs]


def _assert_prompt_logprobs(path, prompts, got, what: str) -> None:
    """Every prompt position's top-2 + prompt token vs transformers (fp32, 1e-4)."""
    for p, g in zip(prompts, got):
        assert len(g.prompt_logprobs) == len(p) and g.prompt_logprobs[0] is None, what
        if len(p) > 1:
            ref = hf_logprobs(path, p[:1], p[1:])
            for j, d in enumerate(g.prompt_logprobs[1:]):
                assert p[j + 1] in d and len(d) in (2, 3), what
                assert all(abs(v - ref[j, t].item()) < 1e-4 for t, v in d.items()), f"{what}: pos {j + 1}"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp_pp_parity(family, ckpts, prompts):
    path = ckpts[family]
    ref = hf_greedy(path, prompts, 32)
    tp1 = _run(path, prompts, 1, 1)
    assert [o.token_ids for o in tp1] == ref
    _assert_prompt_logprobs(path, prompts, tp1, "tp=1")
    # qwen2 adds bias and tied embeddings to the same split.
    for tp, pp in LAYOUTS:
        got = _run(path, prompts, tp, pp)
        _assert_close_to_hf(path, prompts, got, ref, f"tp={tp} pp={pp}")
        _assert_prompt_logprobs(path, prompts, got, f"tp={tp} pp={pp}")


def test_replicated_kv_heads_and_odd_vocab(tmp_path):
    path = make_tiny_model("llama", tmp_path / "m", num_key_value_heads=2, vocab_size=509)
    prompts = random_prompts(4, 3, 40, seed=2, vocab=509)
    ref = hf_greedy(path, prompts, 16)
    llm = LLM(model=path, executor="mp", tensor_parallel_size=4)
    try:
        got = [o.outputs[0] for o in llm.generate(
            prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5),
            use_tqdm=False)]
    finally:
        llm.shutdown()
    _assert_close_to_hf(path, prompts, got, ref, "tp=4, 2 kv heads")


def test_tp_ranks_hold_half_the_weights(ckpts):
    path = ckpts["llama"]
    one = LLM(model=path)
    try:
        total = one.engine.executor.worker.param_bytes()
    finally:
        one.shutdown()
    two = LLM(model=path, executor="mp", tensor_parallel_size=2)
    try:
        per_rank = two.engine.executor.collective_rpc("param_bytes")
    finally:
        two.shutdown()
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
    # Everything but the (replicated, tiny) norms is split in two.
    assert abs(per_rank[0] - total / 2) / total < 0.03, (per_rank, total)


def test_uneven_splits_fail_at_startup(ckpts):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(model=ckpts["llama"], executor="mp", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(5\) is larger than num_hidden_layers \(4\)"):
        LLM(model=ckpts["llama"], executor="mp", pipeline_parallel_size=5)


def test_failing_rank_fails_the_step(ckpts, prompts, monkeypatch):
    use_worker_class(monkeypatch, "probe_workers:FaultyWorker")  # rank 1 raises on step 3
    # No restarts: this is the fail-fast path (test_recovery.py covers recovery).
    llm = LLM(model=ckpts["llama"], executor="mp", tensor_parallel_size=2,
              **{"parallel.max_restarts": 0})
    pids = llm.engine.executor.pids
    try:
        # Raising at all is the point: a failing rank must not leave the step
        # waiting (parallel.step_timeout_s would only catch that after 120 s).
        with pytest.raises(EngineDeadError, match="injected fault"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        with pytest.raises(EngineDeadError, match="injected fault"):
            llm.engine.executor.check_health()
    finally:
        llm.shutdown()
    assert wait_pids_gone(pids, timeout_s=30) == [], "workers outlived shutdown"



def test_tp_rows_stay_aligned_across_turnover(ckpts):
    """A second batch after the first one finished reuses freed rows; both TP
    ranks must agree on them (spawned ranks get different hash seeds)."""
    path = ckpts["llama"]
    prompts = random_prompts(16, 3, 30, seed=31)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    ref = hf_greedy(path, prompts, 8)
    llm = LLM(model=path, executor="mp", tensor_parallel_size=2)
    try:
        for turn in range(2):
            got = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
            _assert_close_to_hf(path, prompts, got, ref, f"turn {turn}")
    finally:
        llm.shutdown()
