"""Prefill/decode disaggregation end to end (docs/disaggregation.md): one
prefill and one decode engine behind the data-parallel client give the
tokens one colocated engine gives, for greedy, seeded, structured and n > 1
requests; the decode engine computes at most the prompt's last partial
block; a prefill engine whose worker is killed mid-run costs no request."""
from __future__ import annotations

import os
import signal
import threading
import time

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
        dp = llm.engine.client  # type: ignore[attr-defined]
        roles = [e["role"] for e in dp.engines()]
        # Every lease ended once its request's decode had the KV (long before kv_lease_s).
        prefill = dp.fleet.client(0).core.scheduler.connector
        deadline = time.monotonic() + 5
        while prefill._leases and time.monotonic() < deadline:
            time.sleep(0.01)  # the leg aborts are applied on the prefill engine's thread
        assert not prefill._leases and not dp.pd._handed
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


def test_drain_moves_the_kv_with_the_requests(tiny_llama, tmp_path):
    """Drain one of two engines with 16 long streams in flight: the moved
    requests load the blocks their old engine left in the shared KV folder
    and compute at most their last partial block again; tokens unchanged."""
    prompts = random_prompts(16, 60, 100, seed=8)
    # Long streams: the drain fires ~20 ms into a decode of ~1 s (tiny model), so
    # half of them are surely still on engine 0 even when a busy CI core stalls
    # this thread for a few hundred ms. At 128 tokens (~0.2 s) a stall had let
    # four of the eight finish first.
    sp = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)
    with LLM(model=tiny_llama, max_model_len=640) as llm:
        ref = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    with LLM(model=tiny_llama, max_model_len=640, data_parallel_size=2, router="round_robin",
             offload_disk_path=str(tmp_path / "kv"), offload_disk_gb=0.05) as llm:
        dp = llm.engine.client  # type: ignore[attr-defined]
        moved: list[int] = []

        def drain_once_all_stream() -> None:  # every request has tokens out: mid-decode
            first: dict[str, int] = {}
            while True:
                with dp._lock:
                    ctx = {r: dp.mover.book.context(r) for r in dp._live}
                for r, n in ctx.items():
                    first.setdefault(r, n)
                if len(first) == 16 and all(ctx.get(r, n + 1) > n for r, n in first.items()):
                    break
                time.sleep(0.002)
            moved.append(dp.drain(0))

        t = threading.Thread(target=drain_once_all_stream)
        t.start()
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
        t.join()
        m = llm.get_metrics()
    assert got == ref
    assert moved[0] >= 6, moved  # about half the streams were on engine 0
    # Tokens the new engine computed again for the moved requests (context - cached):
    # at most the last partial block each; before, the whole context (~100 each).
    again = m['conveyor:migration_reprefill_tokens_total{engine="1"}']
    assert again <= 16 * moved[0], (again, moved)
    assert m['conveyor_kv_reused_tokens_total{source="migration"}'] >= 60 * moved[0]
    assert m.get("conveyor_kv_transfer_failures_total", 0) == 0


def test_peer_fetch_pulls_a_prefix_another_engine_finished(tiny_llama, tmp_path):
    """Round robin sends a conversation's second turn to the other engine:
    with cache.peer_fetch it loads the first turn's blocks from the shared
    folder instead of recomputing them; the tokens are the same either way."""
    first = random_prompts(2, 100, 120, seed=9)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(peer: bool) -> tuple[list[list[int]], dict[str, float]]:
        with LLM(model=tiny_llama, max_model_len=256, data_parallel_size=2, router="round_robin",
                 offload_disk_path=str(tmp_path / ("peer" if peer else "off")), offload_disk_gb=0.05,
                 peer_fetch=peer, peer_fetch_min_tokens=32) as llm:
            outs = [list(o.outputs[0].token_ids) for o in llm.generate(first, sp, use_tqdm=False)]
            # Reversed: round robin then sends each second turn to the other engine.
            second = [p + o + [5, 6, 7] for p, o in zip(first, outs)][::-1]
            outs += [list(o.outputs[0].token_ids) for o in llm.generate(second, sp, use_tqdm=False)]
            return outs, llm.get_metrics()

    off, m_off = run(False)
    on, m_on = run(True)
    assert on == off
    assert m_off.get('conveyor_kv_reused_tokens_total{source="peer"}', 0) == 0
    assert m_on['conveyor_kv_reused_tokens_total{source="peer"}'] >= 2 * 96
    assert m_on.get("conveyor_kv_transfer_failures_total", 0) == 0
