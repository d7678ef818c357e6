"""Multi-LoRA end to end: one batch mixes rows for four PEFT adapters (made
with `peft` at random non-zero A and B: different ranks, target sets, alpha,
rsLoRA) and the base model; every row's greedy tokens equal transformers +
peft running that adapter alone. Also with chunked prefill, preemption and
fewer slots than adapters (LRU eviction, the scheduler's slot cap), TP=2 x
PP=2, TP=2 and PP=2 alone, isolation under prefix caching, and the HTTP
addressing."""
from __future__ import annotations

import pytest
from llm_utils import random_prompts
from lora_utils import RECIPES, hf_lora_greedy, make_adapter

from conveyor.engine import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama, tiny_qwen3):
    """family -> (base dir, [adapter dirs])."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for fam, base in (("llama", tiny_llama), ("qwen3", tiny_qwen3)):
        out[fam] = (base, [make_adapter(base, str(root / f"{fam}-a{i}"), r) for i, r in enumerate(RECIPES)])
    return out


def _mixed(adapters: list[str], n: int) -> list[LoRARequest | None]:
    """Rows cycle over base, a0, a1, a2, a3 (the base is row 0, 5, ...)."""
    return [None if i % 5 == 0 else LoRARequest(f"a{i % 5 - 1}", i % 5, adapters[i % 5 - 1])
            for i in range(n)]


def _refs(base: str, prompts, loras, max_new: int = 10) -> list[list[int]]:
    return [hf_lora_greedy(base, lr.lora_path if lr else None, [p], max_new)[0]
            for p, lr in zip(prompts, loras)]


def _run(base: str, prompts, loras, **kw):
    kw = {"max_model_len": 256, "max_num_seqs": 16, **kw}  # a small KV cache: quick to start
    llm = LLM(base, enable_lora=True, max_lora_rank=8, **kw)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        return [o.outputs[0].token_ids for o in outs], getattr(llm.engine, "scheduler", None)
    finally:
        llm.shutdown()


def test_mixed_batch_matches_peft(models):
    """Qwen3 here, whole prompts in one step and then with chunked prefill
    (a 16-token budget: prompt chunks of several adapters share steps with
    decode rows); the tiny Llama's mixed batch is checked under chunked
    prefill and preemption below."""
    base, adapters = models["qwen3"]
    prompts = random_prompts(10, 3, 40, seed=7)
    loras = _mixed(adapters, len(prompts))
    ref = _refs(base, prompts, loras)
    got, _ = _run(base, prompts, loras, max_loras=4)
    assert got == ref
    assert max(map(len, prompts)) > 16  # so some prompts take several steps
    got, _ = _run(base, prompts, loras, max_loras=4, max_num_batched_tokens=16)
    assert got == ref
    # The adapters matter: each changes the base model's tokens somewhere.
    base_ref = _refs(base, prompts[1:5], [None] * 4)
    assert all(b != r for b, r in zip(base_ref, ref[1:5]))


def test_chunked_prefill_preemption_slot_eviction_and_isolation(models):
    """Two slots for four adapters: the scheduler never puts more than two in
    a step, the workers evict LRU; chunked prefill (64-token budget) and KV
    pressure (preemption by recompute) on top. Then, on the same engine with
    prefix caching, the same prompt for two adapters and the base: each gets
    its own tokens, a repeat of one adapter hits the cache, the others never
    share its KV."""
    base, adapters = models["llama"]
    prompts = random_prompts(10, 30, 60, seed=8)
    loras = _mixed(adapters, len(prompts))
    ref = _refs(base, prompts, loras)
    llm = LLM(base, enable_lora=True, max_lora_rank=8, max_loras=2, max_num_batched_tokens=64,
              num_gpu_blocks=14, max_model_len=128, block_size=16, enable_prefix_caching=True)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert llm.engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == ref
        _check_isolation(llm, base, adapters)
    finally:
        llm.shutdown()


def _check_isolation(llm, base: str, adapters: list[str]) -> None:
    prompt = random_prompts(1, 48, 48, seed=10)[0]
    a, b = LoRARequest("a0", 1, adapters[0]), LoRARequest("a1", 2, adapters[1])
    first, other, again, plain = (llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lr)[0]
                                  for lr in (a, b, a, None))
    assert first.num_cached_tokens == other.num_cached_tokens == plain.num_cached_tokens == 0
    assert again.num_cached_tokens > 0
    ref = _refs(base, [prompt] * 3, [a, b, None])
    assert [first.outputs[0].token_ids, other.outputs[0].token_ids, plain.outputs[0].token_ids] == ref
    assert again.outputs[0].token_ids == ref[0]


@pytest.mark.parametrize("family,tp,pp", [("qwen3", 2, 2), ("llama", 2, 1), ("llama", 1, 2)])
def test_tensor_and_pipeline_parallel(models, family: str, tp: int, pp: int):
    """Qwen3 at TP=2 x PP=2 in one engine, the tiny Llama at TP=2 alone and
    at PP=2 alone (mp executor, ~5 s a start): column-parallel B /
    row-parallel A shards on every rank, and each pipeline stage applies its
    own layers' adapters; the Llama runs under chunked prefill too."""
    base, adapters = models[family]
    prompts = random_prompts(5, 3, 30, seed=9)
    loras = _mixed(adapters, len(prompts))
    kw = {"max_num_batched_tokens": 32} if family == "llama" else {}
    got, _ = _run(base, prompts, loras, max_loras=4, executor="mp", tensor_parallel_size=tp,
                  pipeline_parallel_size=pp, **kw)
    assert got == _refs(base, prompts, loras)


def test_bad_lora_requests_fail_before_queueing(models, tmp_path):
    base, adapters = models["llama"]
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=4)
    try:
        with pytest.raises(ValueError, match="r: rank 8 exceeds lora.max_lora_rank"):
            llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a0", 1, adapters[0]))
        with pytest.raises(ValueError, match="not a directory"):
            llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 2, str(tmp_path / "no")))
        with pytest.raises(ValueError, match="lora_request: got 1 entries for 2 prompts"):
            llm.generate([[5, 6], [7]], GREEDY, use_tqdm=False, lora_request=[None])
        assert not llm.engine.has_work()
    finally:
        llm.shutdown()
    plain = LLM(base)
    try:
        with pytest.raises(ValueError, match="lora_request: LoRA is not enabled"):
            plain.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a1", 1, adapters[1]))
    finally:
        plain.shutdown()


def test_http_adapter_addressing(models):
    """The official openai client over the in-process app (no Ray): `model`
    names an adapter ("a0" or "<base>:a0") and gets its tokens; /v1/models
    lists adapters with `parent`; load/unload at run time sit behind the API
    key; unknown adapter 404, bad directory 400, both OpenAI-shaped."""
    import asyncio

    import httpx
    import openai

    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer, model_name_of
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    base, adapters = models["llama"]
    prompt = random_prompts(1, 6, 6, seed=12)[0]
    refs = _refs(base, [prompt] * 3, [LoRARequest("a0", 1, adapters[0]), LoRARequest("a2", 3, adapters[2]), None], 8)
    cfg = build_config({"lora": {"enable": True, "max_loras": 2, "max_lora_rank": 8,
                                 "adapters": {"a0": adapters[0]}}}, model=base)
    name = model_name_of(cfg)

    async def run() -> None:
        llm = AsyncLLM(cfg)
        server = OpenAIServer(llm, cfg)
        app = build_api(server, api_key="k")
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http, max_retries=0)
        try:
            async with app.router.lifespan_context(app):
                await _http_checks(client, http, llm, name, prompt, refs, adapters)
                await _batch_line_check(server, llm, prompt, refs)
        finally:
            await http.aclose()
            await llm.shutdown()

    asyncio.run(asyncio.wait_for(run(), 120))


async def _batch_line_check(server, llm, prompt, refs) -> None:
    """A batch JSONL line's `model` names the adapter (the batch runner's
    OpenAIServer on the same engine: no second engine start)."""
    from conveyor.cluster.batch.engines import LineRunner

    runner = LineRunner(llm, server)
    body = {"model": "a0", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    rec = await runner.run({"custom_id": "c0", "method": "POST", "url": "/v1/completions", "body": body})
    assert rec["response"]["status_code"] == 200
    assert rec["response"]["body"]["choices"][0]["text"] == llm.tokenizer.decode(refs[0])
    rec = await runner.run({"custom_id": "c1", "url": "/v1/completions", "body": {**body, "model": "nope"}})
    assert rec["response"]["status_code"] == 404


async def _http_checks(client, http, llm, name, prompt, refs, adapters) -> None:
    import openai

    async def tokens(model: str) -> str:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text

    text = llm.tokenizer.decode
    assert await tokens("a0") == text(refs[0]) != text(refs[2])
    assert await tokens(f"{name}:a0") == text(refs[0])
    assert await tokens(name) == text(refs[2])
    models = {m.id: m for m in (await client.models.list()).data}
    assert models["a0"].model_extra["parent"] == name
    with pytest.raises(openai.NotFoundError) as e:
        await tokens("nope")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    # load / unload at run time, behind the key
    body = {"lora_name": "a2", "lora_path": adapters[2]}
    assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 401
    auth = {"Authorization": "Bearer k"}
    r = await http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nope"}, headers=auth)
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "lora_path"
    assert (await http.post("/v1/load_lora_adapter", json=body, headers=auth)).status_code == 200
    assert await tokens("a2") == text(refs[1])
    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=auth)
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        await tokens("a2")
    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
