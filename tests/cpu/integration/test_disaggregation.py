"""Prefill/decode disaggregation end to end (docs/disaggregation.md): one
prefill and one decode engine behind the data-parallel client give the
tokens one colocated engine gives, for greedy, seeded, structured and n > 1
requests; the decode engine computes at most the prompt's last partial
block; a prefill engine whose worker is killed mid-run costs no request."""
from __future__ import annotations

import os
import signal

import pytest
from llm_utils import random_prompts

from conveyor import LLM, SamplingParams
from conveyor.engine import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 22, 333]}}, "required": ["a"],
          "additionalProperties": False}


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.0,
                           structured_outputs=StructuredOutputsParams(json=SCHEMA)),
            SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)]


def _prompts() -> list[list[int]]:
    return random_prompts(4, 40, 90, seed=21)


def _outputs(llm: LLM) -> list[list[list[int]]]:
    outs = llm.generate(_prompts(), _params(), use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def colocated(tiny_llama: str) -> list[list[list[int]]]:
    with LLM(model=tiny_llama, max_model_len=256) as llm:
        return _outputs(llm)


def _pd(path: str, folder: str, **kw) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(model=path, max_model_len=256, data_parallel_size=2, prefill_engines=1,
               offload_disk_path=folder, offload_disk_gb=0.01, **kw)


def test_pd_tokens_equal_one_colocated_engine(tiny_llama, colocated, tmp_path):
    with _pd(tiny_llama, str(tmp_path / "kv")) as llm:
        got = _outputs(llm)
        m = llm.get_metrics()
        roles = [e["role"] for e in llm.engine.client.engines()]  # type: ignore[attr-defined]
    assert got == colocated
    assert roles == ["prefill", "decode"]
    # Every prompt's full blocks came from the prefill engine; the decode engine
    # computed only what follows them (under a block per request, n=2 twice).
    prompts = _prompts()
    handed = sum(len(p) // 16 * 16 for p in prompts) + len(prompts[3]) // 16 * 16
    assert m['conveyor_kv_reused_tokens_total{source="prefill"}'] >= handed - 16 * 5
    assert m['conveyor:prompt_tokens_computed_total{engine="1"}'] <= 16 * 5
    assert m.get("conveyor_kv_transfer_failures_total", 0) == 0


@pytest.mark.parametrize("restarts", [0, 1], ids=["engine_dies", "engine_rebuilds"])
def test_killed_prefill_worker_costs_no_request(tiny_llama, colocated, tmp_path, restarts):
    """SIGKILL the prefill engine's worker as its first leg arrives: its legs
    in flight fail (the engine dies: decode recomputes those prompts) or run
    again (it rebuilds its worker); every request ends with its tokens."""
    with _pd(tiny_llama, str(tmp_path / "kv"), **{"parallel.max_restarts": restarts}) as llm:
        dp = llm.engine.client  # type: ignore[attr-defined]
        victim = dp.engines()[0]["worker_pids"][0]
        prefill = dp.fleet.client(0)
        send = prefill.add_request

        def add_then_kill(request):  # type: ignore[no-untyped-def]
            send(request)
            if prefill.add_request is add_then_kill:
                prefill.add_request = send
                os.kill(victim, signal.SIGKILL)

        prefill.add_request = add_then_kill
        assert _outputs(llm) == colocated
        assert (dp.pd.legs.num_failed > 0) == (restarts == 0)
        assert dp.engines()[0]["state"] == ("dead" if restarts == 0 else "up")
