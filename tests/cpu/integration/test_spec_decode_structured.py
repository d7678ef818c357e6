"""Speculative decoding of structured-output requests: drafts are cut at the
first token the grammar rejects, the core sends one mask row per draft position
(plus the bonus row), the worker masks each draft position's logits, and the
matcher advances by the accepted tokens only. Outputs must stay 100% valid and
greedy-equal to structured decoding without speculation."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from llm_utils import random_prompts
from sched_utils import make_request
from structured_schemas import REGEXES, SCHEMAS

from conveyor.engine import LLM, SamplingParams, StructuredOutputsParams
from conveyor.engine.contracts import GrammarOutput
from conveyor.engine.structured_output.manager import StructuredOutputManager
from conveyor.workers.grammar_mask import apply_grammar_bitmask

DRAFTS = "conveyor:spec_decode_num_draft_tokens"
ACCEPTED = "conveyor:spec_decode_num_accepted_tokens"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
FORMATS = jsonschema.FormatChecker()
PROMPTS = ["Tell me about the cat", "Give me data", "The dog runs to the ball"]


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def manager(ckpt):
    with open(f"{ckpt}/config.json") as f:
        cfg = json.load(f)
    mgr = StructuredOutputManager("llguidance", ckpt, cfg["vocab_size"], lambda: cfg["eos_token_id"])
    yield mgr
    mgr.shutdown()


def _allowed(row: np.ndarray, vocab: int) -> list[int]:
    return [t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1]


def _choice_grammar(manager: StructuredOutputManager):
    params = StructuredOutputsParams(choice=["abab", "cdcd"])
    return manager.backend.compile(params), manager.backend.tokenizer.tokenize_str("abab")


# ---- the core: drafts cut by the grammar, one mask row per draft position ----------------

def test_drafts_cut_at_first_token_the_grammar_rejects(manager):
    import msgspec

    from conveyor.engine.config import EngineConfig
    from conveyor.engine.core.scheduler import Scheduler

    grammar, good = _choice_grammar(manager)
    tree = {"model": {"max_model_len": 256}, "speculative": {**SPEC, "prompt_lookup_min": 1}}
    s = Scheduler(msgspec.convert(tree, EngineConfig), 200)
    # The prompt repeats `good[0], bad`: the n-gram proposer drafts `bad` after good[0].
    bad = next(t for t in range(3, 100) if t not in good)
    req = make_request("a", [good[0], bad, good[0], bad, good[0]], max_tokens=30)
    req.structured_output = type("SOR", (), {"grammar": grammar})()
    s.spec.propose(req)
    assert s.spec.proposer.propose("a", req.all_token_ids, 4)[:1] == [bad]
    assert req.spec_token_ids == []  # the grammar's first token may not be `bad`
    grammar.accept_tokens([good[0]])
    req.all_token_ids = [good[0], good[1], good[0], good[1], bad, good[0]]
    s.spec.proposer.drop("a")
    s.spec.propose(req)  # drafts the 4 tokens after the first good[0]: `bad` is cut
    assert s.spec.proposer.propose("a", req.all_token_ids, 4) == [*good[1:], bad]
    assert req.spec_token_ids == good[1:]


def test_bitmask_rows_per_draft_position_leave_the_matcher_unchanged(manager):
    grammar, good = _choice_grammar(manager)
    vocab = manager.vocab_size
    plain, _ = _choice_grammar(manager)
    mask = manager.bitmask([grammar, plain], [good[:3], []])
    assert mask.shape == (5, manager.num_words)
    # Row j is the mask after the first j drafts: compare with stepping a matcher.
    ref, _ = _choice_grammar(manager)
    for j in range(4):
        assert _allowed(mask[j], vocab) == _allowed(manager.bitmask([ref])[0], vocab)
        if j < 3:
            ref.accept_tokens([good[j]])
    assert _allowed(mask[4], vocab) == _allowed(manager.bitmask([plain])[0], vocab)
    # The matcher was rolled back: it still starts at the grammar's first token.
    assert grammar.valid_prefix(good) == len(good) and grammar.accept_tokens(good[:1])


def test_rows_after_a_drafted_eos_allow_everything(manager):
    """llguidance writes no row after a draft that ends the grammar; the request
    ends at that EOS, but the (unused) row must keep the sampler finite."""
    grammar, good = _choice_grammar(manager)
    grammar.accept_tokens(good)
    eos = manager.backend.tokenizer.eos_token
    mask = manager.bitmask([grammar], [[eos]])
    assert _allowed(mask[0], manager.vocab_size) == [eos]
    assert (mask[1] == -1).all()


def test_worker_applies_row_j_to_draft_position_j():
    logits = torch.zeros(6, 64)
    # Request "p" (1 row) then "s" with 2 drafts (3 rows) then "q" (2 rows, unstructured).
    offsets = np.array([0, 1, 4, 6])
    rows = np.zeros((4, 2), dtype=np.int32)
    for i, tok in enumerate([3, 10, 20, 40]):
        rows[i, tok // 32] = 1 << (tok % 32)
    go = GrammarOutput(["p", "s"], rows.tobytes(), 2, [1, 3])
    apply_grammar_bitmask(logits, ["p", "s", "q"], go, offsets)
    finite = [torch.isfinite(r).nonzero().flatten().tolist() for r in logits]
    assert finite[:4] == [[3], [10], [20], [40]]
    assert finite[4] == finite[5] == list(range(64))
    with pytest.raises(RuntimeError, match="rows"):
        apply_grammar_bitmask(torch.zeros(6, 64), ["p", "s", "q"],
                              GrammarOutput(["s"], rows[:2].tobytes(), 2, [2]), offsets)


# ---- end to end ------------------------------------------------------------------------

def _suite(seed: int = 11) -> list[SamplingParams]:
    greedy = [SamplingParams(max_tokens=200, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(json=s)) for s in SCHEMAS]
    regex = [SamplingParams(max_tokens=40, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(regex=r)) for r in REGEXES]
    return greedy + regex


def _check_valid(outs, params) -> None:
    for o, sp in zip(outs, params):
        c, so = o.outputs[0], sp.structured_outputs
        assert c.finish_reason == "stop", (c.text, so)
        if so.json is not None:
            jsonschema.validate(json.loads(c.text), so.json, format_checker=FORMATS)
        else:
            import re
            assert re.fullmatch(so.regex, c.text), (so.regex, c.text)


@pytest.fixture(scope="module")
def plain_outputs(ckpt):
    params = _suite()
    with LLM(model=ckpt, max_model_len=512) as llm:
        outs = llm.generate([PROMPTS[i % 3] for i in range(len(params))], params, use_tqdm=False)
    return params, outs


# Eight records with the same keys: JSON's fixed punctuation and keys repeat, so
# the n-gram proposer drafts them and the grammar-masked model accepts them.
RECORDS = {"type": "array", "minItems": 8, "maxItems": 8, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "tag": {"enum": ["red", "blue"]}},
    "required": ["id", "tag"], "additionalProperties": False}}


def test_structured_speculative_valid_and_greedy_equal(ckpt, plain_outputs):
    params, plain = plain_outputs
    records = [SamplingParams(max_tokens=300, temperature=t, seed=3,
                              structured_outputs=StructuredOutputsParams(json=RECORDS))
               for t in (0.0, 1.0)]
    seeded = [SamplingParams(max_tokens=200, temperature=1.0, seed=7 + i,
                             structured_outputs=StructuredOutputsParams(json=s))
              for i, s in enumerate(SCHEMAS)]
    with LLM(model=ckpt, max_model_len=512) as llm:
        records_plain = llm.generate(PROMPTS[:2], records[:1] * 2, use_tqdm=False)
    with LLM(model=ckpt, max_model_len=512, speculative_config=SPEC) as llm:
        got = llm.generate(PROMPTS[:2] * 2, records[:1] * 2 + records[1:] * 2, use_tqdm=False)
        m = llm.get_metrics()
        outs = llm.generate([PROMPTS[i % 3] for i in range(len(params))], params, use_tqdm=False)
        m_suite = llm.get_metrics()
        rnd = llm.generate([PROMPTS[i % 3] for i in range(len(seeded))], seeded, use_tqdm=False)
    _check_valid(got, records[:1] * 2 + records[1:] * 2)
    assert [o.outputs[0].token_ids for o in got[:2]] == [o.outputs[0].token_ids for o in records_plain]
    # Structured requests were drafted, and most of their drafts were accepted.
    assert m[DRAFTS] > 50 and m[ACCEPTED] > 0.5 * m[DRAFTS], m
    _check_valid(outs, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].finish_reason for o in outs] == [o.outputs[0].finish_reason for o in plain]
    assert m_suite[DRAFTS] > m[DRAFTS] and m_suite[ACCEPTED] > m[ACCEPTED]
    _check_valid(rnd, seeded)


def test_structured_and_plain_drafting_requests_share_a_batch(ckpt, plain_outputs):
    """Unstructured drafting requests beside drafted structured ones: each gets
    exactly its tokens from a run without speculation; with chunked prefill."""
    params, plain = plain_outputs
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(3, 5, 120, seed=4)
    with LLM(model=ckpt, max_model_len=512) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    picks = [0, 7, 24, 25, len(SCHEMAS)]  # a few JSON schemas and a regex
    with LLM(model=ckpt, max_model_len=512, speculative_config=SPEC,
             max_num_batched_tokens=64) as llm:
        mixed = llm.generate(prompts + [PROMPTS[i % 3] for i in picks],
                             [greedy] * 3 + [params[i] for i in picks], use_tqdm=False)
        assert llm.get_metrics()[ACCEPTED] > 0
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert [o.outputs[0].token_ids for o in mixed[3:]] == [plain[i].outputs[0].token_ids for i in picks]


def test_tp2_chunked_prefill_and_preemption(ckpt):
    """Executor mp at TP=2 (the GrammarOutput's rows per draft travel to both
    ranks), chunked prefill (budget 64) and a pool small enough that decode
    preempts (pending drafts dropped, the matcher never advanced twice):
    greedy-equal to structured decoding without speculation, all valid."""
    prompts = random_prompts(6, 14, 30, seed=4)
    schemas = [RECORDS] + [SCHEMAS[i] for i in (24, 25, 31, 7, 23)]
    params = [SamplingParams(max_tokens=120, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(json=s)) for s in schemas]
    with LLM(model=ckpt, max_model_len=256) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model=ckpt, max_model_len=256, max_num_batched_tokens=64, num_gpu_blocks=17,
             executor="mp", tensor_parallel_size=2, speculative_config=SPEC) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        m = llm.get_metrics()
    assert m[DRAFTS] > 0 and m[ACCEPTED] > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, s in zip(outs, schemas):
        c = o.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), s, format_checker=FORMATS)
        else:  # max_tokens cut a long record list: still the plain run's tokens
            assert c.finish_reason == "length"
