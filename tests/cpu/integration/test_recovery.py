"""A lost worker rank costs no request: the engine rebuilds
its worker group and recomputes every unfinished request; greedy and seeded
outputs equal an undisturbed run. Past the restart budget it fails fast."""
from __future__ import annotations

import os
import signal

import pytest
from llm_utils import pid_alive, random_prompts
from recovery_utils import before_step, greedy_and_seeded, undisturbed_tokens

from conveyor.engine import LLM
from conveyor.engine.core.recovery import RestartBudget
from conveyor.executors.base import EngineDeadError

PROMPTS = random_prompts(6, 5, 70, seed=31)
PARAMS = greedy_and_seeded(6, max_tokens=24, temperature=1.0, seed=40)


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def reference(ckpt):
    return undisturbed_tokens(ckpt, PROMPTS, PARAMS, max_num_batched_tokens=64)


def _kill_rank_at_steps(llm: LLM, rank: int, at: set[int]) -> list[int]:
    """SIGKILL `rank`'s process before the engine's step number in `at`; returns the killed pids."""
    killed: list[int] = []

    def kill() -> None:
        killed.append(llm.worker_pids()[rank])
        os.kill(killed[-1], signal.SIGKILL)
    before_step(llm, at, kill)
    return killed


# The killed rank: TP rank 1 (under async scheduling: the step planned while
# one runs dies with the group), PP stage 1, and stage 1's TP rank 1 of a 2x2 group.
# TP with async scheduling, and TP x PP (the PP-only layout adds no path: the
# group is rebuilt the same way, and PP is in the (2, 2) case).
@pytest.mark.parametrize("tp,pp,rank,async_", [(2, 1, 1, "on"), (2, 2, 3, "auto")])
def test_killed_rank_costs_no_request(ckpt, reference, tp, pp, rank, async_):
    llm = LLM(model=ckpt, executor="mp", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              max_num_batched_tokens=64, async_scheduling=async_)
    assert llm.engine.async_scheduling == (async_ == "on")
    try:
        before = llm.worker_pids()
        killed = _kill_rank_at_steps(llm, rank, {6})
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        after = llm.worker_pids()
        assert llm.engine.num_restarts == 1 and killed == [before[rank]]
        assert len(after) == tp * pp and not set(after) & set(before)
        assert not pid_alive(killed[0])
    finally:
        llm.shutdown()
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_past_the_restart_budget_the_engine_fails_fast(ckpt):
    llm = LLM(model=ckpt, executor="mp", tensor_parallel_size=2, max_num_batched_tokens=64,
              **{"parallel.max_restarts": 1})
    try:
        _kill_rank_at_steps(llm, 0, {3, 9})
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert llm.engine.num_restarts == 1
    finally:
        llm.shutdown()


def test_restart_budget_window():
    now = [0.0]
    b = RestartBudget(2, 600.0, clock=lambda: now[0])
    assert b.take()
    now[0] = 300.0
    assert b.take() and not b.take()
    now[0] = 601.0  # the first restart left the window, the second has not
    assert b.take() and not b.take()


# The rebuild is one path whatever the layout, and the mp cases above already
# lose a rank of a 2x2 group: here a 1x2 pipeline loses its output rank (the
# last stage, which replies to every step), while test_ray_executor.py loses a
# TP rank that does not reply. Two ranks to start and restart instead of eight.
@pytest.mark.parametrize("tp,pp,rank", [(1, 2, 1)])
def test_ray_executor_rebuilds_its_group_in_a_new_placement_group(ray_local, ckpt, reference,
                                                                  tp, pp, rank):
    from ray.util import placement_group_table

    llm = LLM(model=ckpt, executor="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              max_num_batched_tokens=64)
    try:
        before = llm.worker_pids()
        _kill_rank_at_steps(llm, rank, {4})
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        after = llm.worker_pids()
        assert len(after) == tp * pp and not set(after) & set(before)
        live = [pg for pg in placement_group_table().values() if pg["state"] == "CREATED"]
        assert len(live) == 1  # the failed group's placement group was removed
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == reference
