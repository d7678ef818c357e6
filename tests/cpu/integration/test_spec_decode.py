"""N-gram speculative decoding end to end: config, the scheduler's rollback,
greedy parity (k = 1, 3, 5) with the non-speculative engine and transformers
under chunked prefill, prefix caching, preemption and TP=2; the distribution at
drafted positions; seeds, stops, length caps, logprobs and metrics."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from llm_utils import close_or_why, hf_greedy, hf_top5, make_checkpoint, random_prompts
from sched_utils import make_request

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.config import ConfigError, EngineConfig, build_config
from conveyor.engine.contracts import ModelRunnerOutput, SchedulerStats
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.step_output import StepPlan

FAMILIES = ["llama", "qwen2", "qwen3"]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
DRAFTS = "conveyor:spec_decode_num_draft_tokens"
ACCEPTED = "conveyor:spec_decode_num_accepted_tokens"


def spec(k: int, lo: int = 2, hi: int = 4) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
            "prompt_lookup_max": hi}


# ---- config -------------------------------------------------------------------------

def test_config_section_and_kwarg():
    cfg = build_config(model="", speculative_config=spec(3))
    assert cfg.speculative.enabled and cfg.speculative.num_speculative_tokens == 3
    assert not build_config(model="").speculative.enabled
    assert build_config({"speculative": {"method": "ngram"}}).speculative.prompt_lookup_max == 4
    # CLI: --speculative-method / --num-speculative-tokens / --set become dotted keys.
    from conveyor.cluster.cli.options import parse_set

    cli = build_config(model="", **{"speculative.method": "ngram",
                                    **parse_set(["speculative.num_speculative_tokens=6"])})
    assert cli.speculative.enabled and cli.speculative.num_speculative_tokens == 6


@pytest.mark.parametrize("section,needle", [
    ({"method": "eagle"}, "speculative.method: expected null or ngram"),
    ({"method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens: expected int in 1..8"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens: expected int in 1..8"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max: expected int >= speculative.prompt_lookup_min (3)"),
    ({"method": "ngram", "num_speculative_token": 2}, "unknown key (did you mean 'num_speculative_tokens'?)"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens: expected int in 1..8"),
])
def test_config_rejects(section, needle):
    with pytest.raises(ConfigError, match=None) as e:
        build_config(model="", speculative_config=section)
    assert needle in str(e.value)


def test_config_refuses_pipeline_parallel():
    with pytest.raises(ConfigError) as e:
        build_config(model="", speculative_config=spec(2), pipeline_parallel_size=2)
    assert "speculation with pipeline parallelism is not supported" in str(e.value)


# ---- scheduler ------------------------------------------------------------------------

def _sched(k: int = 3, **cache) -> Scheduler:
    tree = {"model": {"max_model_len": 256}, "cache": {"block_size": 4, **cache},
            "speculative": spec(k, 1, 3)}
    return Scheduler(msgspec.convert(tree, EngineConfig), 200)


def _out(so, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [tokens.get(r, []) for r in ids])


def test_scheduler_drafts_rollback_and_exact_hashes():
    s = _sched(k=3, enable_prefix_caching=True)
    req = make_request("a", [5, 6, 7, 8, 5, 6, 7], max_tokens=20)
    s.add_request(req)
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {}
    s.update_from_output(so, _out(so, {"a": [8]}))
    assert req.spec_token_ids == [5, 6, 7]  # [5 6 7 8] seen before
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [5, 6, 7]}
    assert so.num_scheduled_tokens["a"] == 4
    assert req.num_computed_tokens == 11  # 8 known + 3 drafts
    # One draft accepted, then a different token: 2 rejected drafts roll back.
    out = s.update_from_output(so, _out(so, {"a": [5, 9]}))
    assert out.outputs[0].new_token_ids == [5, 9]
    assert req.num_computed_tokens == 9 == len(req.all_token_ids) - 1
    assert req.all_token_ids == [5, 6, 7, 8, 5, 6, 7, 8, 5, 9]
    # Hashes cover the real tokens only (2 full blocks of 4).
    assert len(req.block_hashes) == 2
    assert out.scheduler_stats.spec_num_draft_tokens == 3
    assert out.scheduler_stats.spec_num_accepted_tokens == 1
    assert out.scheduler_stats.spec_accepted_per_pos == [1, 0, 0]


def test_scheduler_drafts_respect_max_tokens_and_stops():
    s = _sched(k=5)
    req = make_request("a", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=3, stop_token_ids=[99])
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, _out(so, {"a": [3]}))
    # 1 output, max_tokens 3: one draft + the bonus token at most.
    assert req.spec_token_ids == [1]
    so = s.schedule()
    s.update_from_output(so, _out(so, {"a": [1, 2]}))
    assert req.is_finished() and req.output_token_ids == [3, 1, 2]
    # Tokens after a stop id in an accepted run are dropped.
    s = _sched(k=5)
    req = make_request("b", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=30, stop_token_ids=[99])
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, _out(so, {"b": [3]}))
    so = s.schedule()
    out = s.update_from_output(so, _out(so, {"b": [1, 99, 3]}))
    assert out.outputs[0].new_token_ids == [1, 99] and req.stop_reason == 99


def test_scheduler_preemption_drops_drafts_and_budget_truncates():
    tree = {"model": {"max_model_len": 256},
            "scheduler": {"max_num_batched_tokens": 3, "max_num_seqs": 1},
            "cache": {"block_size": 4, "enable_prefix_caching": False}, "speculative": spec(4, 1, 3)}
    s = Scheduler(msgspec.convert(tree, EngineConfig), 200)
    req = make_request("a", [1, 2, 1], max_tokens=30)
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, _out(so, {"a": [2]}))
    assert req.spec_token_ids == [1, 2]
    so = s.schedule()  # budget 3: the last token + 2 drafts
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]}
    s.update_from_output(so, _out(so, {"a": [1, 2, 1]}))
    assert req.spec_token_ids  # [.. 1 2 1] proposes again
    s._preempt(req, StepPlan(token_budget=0))
    assert req.spec_token_ids == [] and req.num_computed_tokens == 0


def test_scheduler_backs_off_after_rejected_drafts():
    """n consecutive all-rejected verifications: no drafts for 2**n - 1 steps
    (capped); one accepted draft resets it."""
    from conveyor.engine.spec_decode.scheduling import MAX_BACKOFF

    s = _sched(k=3)
    req = make_request("a", [5, 6, 7, 8, 5, 6, 7, 8], max_tokens=60)

    def drafted_steps(n: int) -> list[bool]:
        out = []
        for _ in range(n):
            s.spec.propose(req)
            out.append(bool(req.spec_token_ids))
        return out

    assert drafted_steps(1) == [True]
    s.spec.verify(req, [5, 6, 7], 1)  # nothing accepted
    assert drafted_steps(2) == [False, True]
    s.spec.verify(req, [5, 6, 7], 1)
    assert drafted_steps(4) == [False] * 3 + [True]
    for _ in range(6):
        s.spec.verify(req, [5, 6, 7], 1)
    assert drafted_steps(MAX_BACKOFF + 1) == [False] * MAX_BACKOFF + [True]
    s.spec.verify(req, [5, 6, 7], 2)  # one accepted: drafted again at once
    assert drafted_steps(2) == [True, True]
    s.spec.verify(req, [5, 6, 7], 1)
    assert drafted_steps(2) == [False, True]


# ---- end to end ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(tiny_llama, tiny_qwen2, tiny_qwen3):
    return {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, 1, 150, seed=4)


@pytest.fixture(scope="module")
def base(ckpts, prompts):
    out = {}
    for f, p in ckpts.items():
        with LLM(model=p) as llm:
            out[f] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return out


@pytest.fixture(scope="module")
def refs(ckpts, prompts):
    return {f: hf_greedy(p, prompts, GREEDY.max_tokens) for f, p in ckpts.items()}


def _check(family, ckpts, prompts, base, refs, got):
    assert got == base[family]
    for o, r, p in zip(got, refs[family], prompts):
        if o != r:  # vLLM's rule; before the divergence both share HF's prefix
            path = ckpts[family]
            assert close_or_why(o, hf_top5(path, p, o), r, hf_top5(path, p, r)) is None


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_chunked_prefix_cached(family, k, ckpts, prompts, base, refs):
    with LLM(model=ckpts[family], speculative_config=spec(k), max_num_batched_tokens=64) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        m = llm.get_metrics()
    _check(family, ckpts, prompts, base, refs, first)
    _check(family, ckpts, prompts, base, refs, [o.outputs[0].token_ids for o in again])
    assert max(o.num_cached_tokens for o in again) > 0  # prefix caching was exercised
    assert m[DRAFTS] > 0 and m[ACCEPTED] > 0
    assert m[ACCEPTED] == sum(v for n, v in m.items() if "per_pos" in n)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_under_preemption(family, ckpts, prompts, base, refs):
    with LLM(model=ckpts[family], speculative_config=spec(3), num_gpu_blocks=20,
             max_model_len=256) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.get_metrics()[ACCEPTED] > 0
    _check(family, ckpts, prompts, base, refs, got)


def test_greedy_parity_tp2(ckpts, prompts, base, refs):
    with LLM(model=ckpts["llama"], speculative_config=spec(3), executor="mp",
             tensor_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.get_metrics()[ACCEPTED] > 0
    _check("llama", ckpts, prompts, base, refs, got)


def test_greedy_parity_ray_tp2(ray_local, ckpts, prompts, base, refs):
    """Drafts travel to both ranks in the SchedulerOutput; the core runs in its actor."""
    with LLM(model=ckpts["qwen3"], speculative_config=spec(3), executor="ray",
             tensor_parallel_size=2, max_num_batched_tokens=64) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        m = llm.get_metrics()
    assert m[DRAFTS] > 0 and m[ACCEPTED] > 0
    _check("qwen3", ckpts, prompts, base, refs, got)


def test_stops_and_length_caps(ckpts, prompts, base):
    b = base["llama"]
    stop = next(t for t in b[0][3:] if b[0].count(t) > 1)  # a token the cycle repeats
    with LLM(model=ckpts["llama"], speculative_config=spec(5), max_model_len=200) as llm:
        sp = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
        out = llm.generate([prompts[0]], sp, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == b[0][:b[0].index(stop) + 1] and out.finish_reason == "stop"
        for n in (1, 2, 7, 13):
            sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            assert [len(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)] \
                == [n] * len(prompts)
        sp = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
        for o, p in zip(llm.generate(prompts, sp, use_tqdm=False), prompts):
            assert len(p) + len(o.outputs[0].token_ids) == 200
            assert o.outputs[0].finish_reason == "length"


def test_logprobs_for_every_token(ckpts, prompts):
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    with LLM(model=ckpts["qwen2"]) as llm:
        plain = llm.generate(prompts, sp, use_tqdm=False)
    with LLM(model=ckpts["qwen2"], speculative_config=spec(4)) as llm:
        fast = llm.generate(prompts, sp, use_tqdm=False)
        assert llm.get_metrics()[ACCEPTED] > 0
    for a, b in zip(plain, fast):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for la, lb, t in zip(a.logprobs, b.logprobs, b.token_ids):
            assert t in lb and set(la) == set(lb)
            assert all(abs(la[i] - lb[i]) < 1e-4 for i in la)


def test_seeded_identical_alone_and_batched(ckpts, prompts):
    seeded = SamplingParams(max_tokens=32, temperature=0.8, top_k=20, seed=123, ignore_eos=True)
    other = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with LLM(model=ckpts["llama"], speculative_config=spec(4, 1, 3)) as llm:
        alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
        batch = llm.generate([prompts[0], prompts[1], prompts[2]], [other, seeded, greedy],
                             use_tqdm=False)
        assert llm.get_metrics()[ACCEPTED] > 0
    assert batch[1].outputs[0].token_ids == alone


# ---- distribution at drafted positions ----------------------------------------------------

def _chi2_two_sample_p(a: np.ndarray, b: np.ndarray) -> float:
    keep = (a + b) >= 10
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    table = np.stack([a, b]).astype(float)
    table = table[:, table.sum(0) > 0]
    exp = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - exp) ** 2 / exp).sum())
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    # A peaky small-vocab model, so top-p 0.9 really cuts tokens.
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("v16") / "m"), vocab_size=16,
                           initializer_range=0.4)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_distribution_at_drafted_positions(small_vocab, top_p):
    """Every token occurs in the prompt, so with prompt_lookup_min=1 the second
    output token is always drafted (the third when that draft is accepted);
    their distributions must match sampling without speculation."""
    n = 600
    sp = SamplingParams(max_tokens=3, temperature=1.0, top_p=top_p, ignore_eos=True)
    # block_size 8: identical prompts hit 3 cached blocks, so prefill is short.
    kw = dict(model=small_vocab, max_num_seqs=256, max_num_batched_tokens=2048, block_size=8,
              attention_backend="torch")
    with LLM(**kw) as llm:
        # Every token, then the model's own greedy cycle: drafts are often likely.
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        prompt = list(range(16)) + llm.generate([list(range(16))], greedy, use_tqdm=False)[0].outputs[0].token_ids
        plain = np.array([o.outputs[0].token_ids for o in llm.generate([prompt] * n, sp, use_tqdm=False)])
    with LLM(**kw, speculative_config=spec(2, 1, 2)) as llm:
        fast = np.array([o.outputs[0].token_ids for o in llm.generate([prompt] * n, sp, use_tqdm=False)])
        m = llm.get_metrics()
    assert m["conveyor:spec_decode_num_drafts"] >= n  # every request verified a draft
    for pos in (1, 2):
        a = np.bincount(plain[:, pos], minlength=16)
        b = np.bincount(fast[:, pos], minlength=16)
        assert _chi2_two_sample_p(a, b) > 0.01, (pos, a, b)
    assert 0 < m[ACCEPTED] < m[DRAFTS]


# ---- metrics on /metrics ------------------------------------------------------------------

def test_prometheus_exposes_spec_counters():
    from fake_engines import FakeEngineClient

    from conveyor.cluster.openai.metrics import ServeMetrics
    from conveyor.engine.frontend.async_client import EngineCounters

    class FakeLLM:
        stats = SchedulerStats()
        counters = EngineCounters()
        client = FakeEngineClient()  # one engine: no fleet rows

    llm = FakeLLM()
    for _ in range(2):
        llm.counters.spec_decode.absorb(SchedulerStats(
            spec_num_drafts=2, spec_num_draft_tokens=6, spec_num_accepted_tokens=3,
            spec_accepted_per_pos=[2, 1, 0]))
    text = ServeMetrics(llm, "m").render().decode()
    assert 'conveyor:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0' in text
    assert 'conveyor:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0' in text
    assert 'conveyor:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6.0' in text
    assert 'conveyor:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text


# ---- structured outputs next to drafting requests (more in test_spec_decode_structured.py) ----

def test_structured_requests_share_the_batch(ckpts, prompts, base):
    from conveyor.engine import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    so = SamplingParams(max_tokens=200, temperature=0.0,
                        structured_outputs=StructuredOutputsParams(json=schema))
    with LLM(model=ckpts["llama"]) as llm:
        alone = llm.generate(["Give me data"], so, use_tqdm=False)[0].outputs[0]
    with LLM(model=ckpts["llama"], speculative_config=spec(3)) as llm:
        outs = llm.generate([prompts[0], "Give me data", prompts[1]], [GREEDY, so, GREEDY],
                            use_tqdm=False)
        assert llm.get_metrics()[ACCEPTED] > 0
    assert outs[0].outputs[0].token_ids == base["llama"][0]
    assert outs[2].outputs[0].token_ids == base["llama"][1]
    got = outs[1].outputs[0]
    assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason


# ---- the serving path: AsyncLLM + the OpenAI app's /metrics ------------------------------------

def test_async_llm_and_metrics_endpoint(ckpts, prompts, base):
    import asyncio

    import httpx

    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.frontend.async_client import AsyncLLM, collect

    cfg = build_config({"model": {"path": ckpts["llama"]}, "speculative": spec(3),
                        "serve": {"served_model_name": "tiny", "metrics_public": True}})

    async def run() -> tuple[list[list[int]], str]:
        llm = AsyncLLM(cfg)
        srv = OpenAIServer(llm, cfg)
        app = build_api(srv, api_key=None)
        await srv.start()
        try:
            outs = await asyncio.gather(*(collect(llm.generate(p, GREEDY)) for p in prompts))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                text = (await c.get("/metrics")).text
            return [o.outputs[0].token_ids for o in outs], text
        finally:
            await llm.shutdown()

    got, text = asyncio.run(run())
    assert got == base["llama"]
    line = next(x for x in text.splitlines()
                if x.startswith("conveyor:spec_decode_num_accepted_tokens_total{"))
    assert float(line.rsplit(" ", 1)[1]) > 0
