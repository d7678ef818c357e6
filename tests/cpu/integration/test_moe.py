"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) end to end: greedy
outputs against transformers on tiny random checkpoints (vLLM's top-5 rule at
a divergence), with chunked prefill and prefix-cache hits, preemption, TP=2
with the experts sharded and with expert parallelism (executors mp and ray),
PP=2, and a LoRA adapter on the attention projections (peft's tokens); a
checkpoint that lacks an expert fails at load, naming the tensor."""
from __future__ import annotations

import pytest
from llm_utils import close_or_why, engine_top5, hf_greedy, hf_top5, make_checkpoint, random_prompts
from safetensors.torch import load_file, save_file

from conveyor.engine import LLM, SamplingParams

FAMILIES = ["mixtral", "qwen2-moe", "qwen3-moe"]
TOKENS = 24
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def ckpts(tiny_mixtral, tiny_qwen2_moe, tiny_qwen3_moe):
    return {"mixtral": tiny_mixtral, "qwen2-moe": tiny_qwen2_moe, "qwen3-moe": tiny_qwen3_moe}


@pytest.fixture(scope="module")
def prompts():
    prefix = random_prompts(1, 32, 32, seed=21)[0]  # two full blocks, shared
    return random_prompts(3, 1, 120, seed=22) + random_prompts(3, 1, 40, seed=23, prefix=prefix)


@pytest.fixture(scope="module")
def refs(ckpts, prompts):
    return {f: hf_greedy(p, prompts, TOKENS) for f, p in ckpts.items()}


def _check(path: str, prompts: list[list[int]], ref: list[list[int]], outs) -> None:
    for p, r, o in zip(prompts, ref, outs):
        c = o.outputs[0]
        why = close_or_why(c.token_ids, engine_top5(c), r, hf_top5(path, p, r))
        assert why is None, why


def _run(path: str, prompts: list[list[int]], **kw):
    with LLM(model=path, max_model_len=512, **kw) as llm:
        return llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_with_chunked_prefill_and_prefix_hits(family, ckpts, prompts, refs):
    outs = _run(ckpts[family], prompts, max_num_batched_tokens=48, enable_prefix_caching=True)
    _check(ckpts[family], prompts, refs[family], outs)
    assert all(o.num_cached_tokens >= 32 for o in outs[4:])  # the shared prefix came from the cache


@pytest.mark.parametrize(("family", "expert_parallel"), [("qwen2-moe", True), ("mixtral", False),
                                                         ("qwen3-moe", True)])
def test_tp2_sharded_or_expert_parallel_matches_hf(family, expert_parallel, ckpts, prompts, refs):
    outs = _run(ckpts[family], prompts, tensor_parallel_size=2, executor="mp",
                enable_expert_parallel=expert_parallel)
    _check(ckpts[family], prompts, refs[family], outs)


@pytest.mark.parametrize("expert_parallel", [True, False])
def test_tp2_on_ray_matches_hf(ray_local, ckpts, prompts, refs, expert_parallel):
    outs = _run(ckpts["qwen3-moe"], prompts, tensor_parallel_size=2, executor="ray",
                enable_expert_parallel=expert_parallel)
    _check(ckpts["qwen3-moe"], prompts, refs["qwen3-moe"], outs)


def test_preemption_matches_hf(ckpts):
    """8 prompts of 30 tokens growing to 54 need more than 16 blocks: decode
    preempts (recompute) and resumes, and the tokens stay transformers'."""
    path = ckpts["qwen3-moe"]
    same_len = random_prompts(8, 30, 30, seed=5)
    ref = hf_greedy(path, same_len, TOKENS)
    with LLM(model=path, max_model_len=256, num_gpu_blocks=17) as llm:
        outs = llm.generate(same_len, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    _check(path, same_len, ref, outs)


def test_lora_on_the_attention_projections_matches_peft(ckpts, tmp_path):
    """An adapter on q/k/v/o of a mixture-of-experts model, beside base rows in
    one batch: transformers + peft's tokens for each row."""
    from lora_utils import AdapterRecipe, hf_lora_greedy, make_adapter

    from conveyor.engine import LoRARequest

    path = ckpts["qwen3-moe"]
    adapter = make_adapter(path, str(tmp_path / "attn"), AdapterRecipe(4, 8, ("q_proj", "k_proj", "v_proj", "o_proj"),
                                                                       seed=6))
    prompts = random_prompts(4, 5, 40, seed=24)
    loras = [None if i % 2 == 0 else LoRARequest("attn", 1, adapter) for i in range(len(prompts))]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(model=path, max_model_len=256, enable_lora=True, max_lora_rank=8) as llm:
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    ref = [hf_lora_greedy(path, lr.lora_path if lr else None, [p], 10)[0] for p, lr in zip(prompts, loras)]
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert hf_lora_greedy(path, None, prompts[1:2], 10) != ref[1:2]  # the adapter changes the tokens


def test_speculation_structured_outputs_and_two_engines_on_moe(ckpts, prompts, refs):
    """n-gram drafts and a JSON-schema request in one batch, then two engines
    behind the router: still transformers' tokens, and the JSON parses."""
    import json

    from conveyor.engine import StructuredOutputsParams

    path = ckpts["qwen2-moe"]
    schema = {"type": "object", "properties": {"a": {"enum": [1, 22, 333]}}, "required": ["a"],
              "additionalProperties": False}  # bounded: a random model must close it
    so = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(model=path, max_model_len=512, speculative_config=spec) as llm:
        outs = llm.generate(prompts + [[5, 6, 7]], [GREEDY] * len(prompts) + [so], use_tqdm=False)
    _check(path, prompts, refs["qwen2-moe"], outs[:-1])
    assert outs[-1].outputs[0].finish_reason == "stop", outs[-1].outputs[0]
    assert json.loads(outs[-1].outputs[0].text)["a"] in (1, 22, 333)
    outs = _run(path, prompts, data_parallel_size=2)
    _check(path, prompts, refs["qwen2-moe"], outs)


def test_pp2_matches_hf(ckpts, prompts, refs):
    outs = _run(ckpts["qwen2-moe"], prompts, pipeline_parallel_size=2, executor="mp")
    _check(ckpts["qwen2-moe"], prompts, refs["qwen2-moe"], outs)


def test_missing_expert_is_named_at_load(tmp_path):
    from conveyor.workers.model_loader import load_hf_config, load_model

    path = make_checkpoint("qwen3-moe", str(tmp_path / "m"))
    f = f"{path}/model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(path, load_hf_config(path), __import__("torch").float32, "cpu")


def test_expert_of_the_wrong_shape_is_named_at_load(tmp_path):
    import torch

    from conveyor.workers.model_loader import load_hf_config, load_model

    path = make_checkpoint("mixtral", str(tmp_path / "m"))
    f = f"{path}/model.safetensors"
    tensors = load_file(f)
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}.*expert 2 down.*does not match"):
        load_model(path, load_hf_config(path), torch.float32, "cpu")


def test_routed_tokens_per_expert_are_counted(ckpts):
    """Every token of every sparse layer goes to top_k experts: the routing
    metric counts exactly that (qwen3-moe: one sparse layer, top-2)."""
    prompt = list(range(5, 25))
    with LLM(model=ckpts["qwen3-moe"], max_model_len=512) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
        routed = {k: v for k, v in llm.get_metrics().items() if k.startswith("conveyor:moe_routed_tokens")}
    # 20 prompt tokens, then 5 decode steps (the 6th token is sampled, never fed back).
    assert len(routed) == 8 and sum(routed.values()) == 2 * (20 + 5)


def test_prometheus_exposes_routed_tokens_per_expert():
    from fake_engines import FakeEngineClient

    from conveyor.cluster.openai.metrics import ServeMetrics
    from conveyor.engine.contracts import SchedulerStats
    from conveyor.engine.frontend.async_client import EngineCounters

    class FakeLLM:
        stats = SchedulerStats()
        counters = EngineCounters()
        client = FakeEngineClient()

    llm = FakeLLM()
    for _ in range(2):
        llm.counters.experts.absorb(SchedulerStats(moe_routed_tokens=[3, 0, 5]))
    text = ServeMetrics(llm, "m").render().decode()
    assert 'conveyor:moe_routed_tokens_total{expert="0",model_name="m"} 6.0' in text
    assert 'conveyor:moe_routed_tokens_total{expert="2",model_name="m"} 10.0' in text
