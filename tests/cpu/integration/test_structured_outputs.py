"""Structured outputs through the grammar-bitmask stage, offline and on every
executor. The tiny random-weight models emit noise when unconstrained, so only
the mask can make an output parse: every output must validate and finish."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from llm_utils import random_prompts
from structured_schemas import CHOICES, LARK, REGEXES, SCHEMAS

from conveyor.engine import LLM, SamplingParams, StructuredOutputsParams
from conveyor.engine.contracts import RequestStatus

FORMATS = jsonschema.FormatChecker()
PROMPTS = ["Tell me about the cat", "Give me data", "The dog runs to the ball"]


def _json_params(schema: dict, temperature: float, seed: int | None = None,
                 max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=schema))


def _assert_valid(schema: dict, out) -> None:
    assert out.finish_reason == "stop", (out.text, out.finish_reason)
    jsonschema.validate(json.loads(out.text), schema, format_checker=FORMATS)


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def llm(ckpt):
    engine = LLM(model=ckpt, max_model_len=512)
    yield engine
    engine.shutdown()


def _suite_params(seed: int = 11) -> list[SamplingParams]:
    return ([_json_params(s, 0.0) for s in SCHEMAS]
            + [_json_params(s, 1.0, seed + i) for i, s in enumerate(SCHEMAS)])


def _check_suite(outs, params) -> None:
    for o, sp in zip(outs, params):
        _assert_valid(sp.structured_outputs.json, o.outputs[0])


# ---- offline, uniproc ----------------------------------------------------------------

def test_json_schema_suite_greedy_and_seeded(llm):
    assert len(SCHEMAS) >= 30
    params = _suite_params()
    outs = llm.generate([PROMPTS[i % 3] for i in range(len(params))], params, use_tqdm=False)
    _check_suite(outs, params)
    m = llm.get_metrics() if hasattr(llm, "get_metrics") else None
    assert llm.engine.structured_output_manager.stats.num_requests >= len(params)
    del m


def test_regex_choice_and_lark(llm):
    params = ([SamplingParams(max_tokens=40, temperature=t, seed=3,
                              structured_outputs=StructuredOutputsParams(regex=r)) for r in REGEXES for t in (0.0, 1.0)]
              + [SamplingParams(max_tokens=40, temperature=t, seed=4,
                                structured_outputs=StructuredOutputsParams(choice=c)) for c in CHOICES for t in (0.0, 1.0)]
              + [SamplingParams(max_tokens=60, temperature=t, seed=5,
                                structured_outputs=StructuredOutputsParams(grammar=LARK)) for t in (0.0, 1.0)])
    outs = llm.generate(["x"] * len(params), params, use_tqdm=False)
    lark_re = re.compile(r"^[0-9(][0-9()+\-]*$")
    for o, sp in zip(outs, params):
        c, so = o.outputs[0], sp.structured_outputs
        assert c.finish_reason == "stop", (c.text, so)
        if so.regex is not None:
            assert re.fullmatch(so.regex, c.text), (so.regex, c.text)
        elif so.choice is not None:
            assert c.text in so.choice
        else:
            assert lark_re.match(c.text) and c.text.count("(") == c.text.count(")"), c.text


def test_json_object_and_string_schema(llm):
    sp = SamplingParams(max_tokens=300, temperature=0.0,
                        structured_outputs=StructuredOutputsParams(json_object=True))
    c = llm.generate(["x"], sp, use_tqdm=False)[0].outputs[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)
    else:  # an unbounded language may run out of tokens, but the prefix is JSON
        assert c.finish_reason == "length" and c.text.startswith("{")
    schema = SCHEMAS[1]
    c = llm.generate(["x"], SamplingParams(max_tokens=100, temperature=0.0, structured_outputs=
                     StructuredOutputsParams(json=json.dumps(schema))), use_tqdm=False)[0].outputs[0]
    _assert_valid(schema, c)


def test_max_tokens_cut_is_length(llm):
    schema = SCHEMAS[25]  # two $ref'd objects: far longer than 4 tokens
    c = llm.generate(["x"], _json_params(schema, 0.0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_unstructured_rows_unchanged_by_structured_neighbours(llm):
    plain = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 3
    prompts = random_prompts(3, 5, 60, seed=9)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    structured = [_json_params(s, 0.0) for s in SCHEMAS[:6]]
    mixed = llm.generate(prompts + ["y"] * 6, plain + structured, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    _check_suite(mixed[3:], structured)


def test_seeded_structured_batch_invariant(llm):
    params = [_json_params(s, 1.0, 100 + i) for i, s in enumerate(SCHEMAS[:8])]
    batch = [o.outputs[0].token_ids for o in llm.generate(["z"] * 8, params, use_tqdm=False)]
    alone = [llm.generate(["z"], sp, use_tqdm=False)[0].outputs[0].token_ids for sp in params[:3]]
    assert batch[:3] == alone


def test_invalid_constraints_raise_before_queueing(llm):
    bad = [dict(json={"type": "objekt"}), dict(json={"type": "string", "pattern": "(("}),
           dict(json="{not json"), dict(regex="(ab"), dict(grammar="start: undefined_rule"),
           dict(json={"type": "array", "uniqueItems": True})]
    for b in bad:
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**b)),
                         use_tqdm=False)
    for kw in (dict(regex="a", choice=["a"]), dict(), dict(choice=[]), dict(json_object="yes")):
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputsParams(**kw)
    assert not llm.engine.scheduler.has_requests()


def test_compile_failure_in_core_ends_request_with_error(llm):
    """A constraint that skipped the frontend's check fails in the compile thread:
    the request ends with an error and the engine goes on."""
    from conveyor.engine.contracts import EngineCoreRequest
    from conveyor.engine.core.request import Request

    sp = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(ab"))
    ecr = EngineCoreRequest(request_id="direct-0", prompt_token_ids=[5, 6, 7], sampling_params=sp)
    core = llm.engine
    core.scheduler.add_request(Request.from_engine_core_request(ecr, 512))
    outs = []
    while core.has_work():
        o, _ = core.step()
        outs += o.outputs
    [err] = [o for o in outs if o.request_id == "direct-0"]
    assert str(err.finish_reason) == "error" and "compile" in err.error
    ok = llm.generate(["x"], _json_params(SCHEMAS[0], 0.0), use_tqdm=False)[0].outputs[0]
    _assert_valid(SCHEMAS[0], ok)


def test_chunked_prefill_prefix_cache_and_preemption(ckpt):
    """Long shared-prefix prompts (chunked at 64 tokens, prefix-cache hits) in a
    pool small enough that decode preempts: every output still validates."""
    prefix = random_prompts(1, 16, 16, seed=3)[0]  # one shared block
    prompts = random_prompts(8, 14, 14, seed=4, prefix=prefix)
    # The longer languages, so outputs outgrow the 16 usable blocks.
    schemas = [SCHEMAS[i] for i in (24, 25, 31, 7, 23, 9, 32, 33)]
    params = [_json_params(s, 1.0, 7 + i, max_tokens=100) for i, s in enumerate(schemas)]
    # executor "mp": its worker process holds its own torch.distributed world,
    # beside the module's in-process engine.
    llm = LLM(model=ckpt, max_model_len=256, max_num_batched_tokens=64, num_gpu_blocks=17,
              executor="mp")
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        sched = llm.engine.scheduler
        assert sched.num_preemptions > 0
        assert any(o.num_cached_tokens > 0 for o in outs)
    finally:
        llm.shutdown()
    _check_suite(outs, params)


# ---- the scheduler's bitmask contract (no model) -----------------------------------

def test_grammar_bitmask_only_for_sampling_structured_rows():
    import tempfile

    from sched_utils import create_scheduler, fake_output, make_request
    from tokenizer_utils import train_tiny_tokenizer

    from conveyor.engine.structured_output.manager import StructuredOutputManager

    tok_dir = tempfile.mkdtemp()
    train_tiny_tokenizer(tok_dir)
    sched = create_scheduler(max_num_batched_tokens=40)
    sched.structured_output_manager = StructuredOutputManager("llguidance", tok_dir, 520, lambda: 1)
    plain = make_request("plain", [7] * 8)
    so_req = make_request("so", [9] * 50, structured_outputs=StructuredOutputsParams(regex="ab"))
    sched.add_request(plain)
    sched.add_request(so_req)
    assert so_req.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    so_req.structured_output.future.result()  # compiled off the loop
    out = sched.schedule()  # 8 + 32 of 50: the structured prompt is a partial chunk
    assert out.num_scheduled_tokens == {"plain": 8, "so": 32}
    assert not out.has_structured_output and sched.get_grammar_bitmask(out) is None
    sched.update_from_output(out, fake_output(out, sched, token=5))
    out = sched.schedule()
    assert out.has_structured_output
    go = sched.get_grammar_bitmask(out)
    assert go.structured_output_request_ids == ["so"] and go.bitmask().shape == (1, 17)
    mask = go.bitmask()[0]
    allowed = [t for t in range(520) if (mask[t // 32] >> (t % 32)) & 1]
    assert allowed and all(t < 512 for t in allowed)  # ids past the tokenizer never allowed
    sched.structured_output_manager.shutdown()


# ---- other executors ------------------------------------------------------------------

def test_mp_tensor_parallel(ckpt, llm):
    params = _suite_params()[:10] + _suite_params()[len(SCHEMAS):len(SCHEMAS) + 4]
    ref = [o.outputs[0].token_ids for o in llm.generate(["q"] * len(params), params, use_tqdm=False)]
    tp = LLM(model=ckpt, max_model_len=512, executor="mp", tensor_parallel_size=2)
    try:
        outs = tp.generate(["q"] * len(params), params, use_tqdm=False)
    finally:
        tp.shutdown()
    _check_suite(outs, params)
    assert [o.outputs[0].token_ids for o in outs] == ref


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_ray_tp_pp_batch_queue(ray_local, ckpt, tp, pp):
    params = _suite_params()
    engine = LLM(model=ckpt, max_model_len=512, executor="ray", tensor_parallel_size=tp,
                 pipeline_parallel_size=pp, max_num_batched_tokens=64)
    try:
        outs = engine.generate([PROMPTS[i % 3] for i in range(len(params))], params, use_tqdm=False)
    finally:
        engine.shutdown()
    _check_suite(outs, params)
