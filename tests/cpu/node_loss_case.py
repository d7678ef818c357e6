"""What tests/cpu/integration/test_node_loss.py and its driver process share: the requests
and the engine's config."""
from __future__ import annotations

from llm_utils import random_prompts
from recovery_utils import greedy_and_seeded

PROMPTS = random_prompts(4, 5, 40, seed=44)
# 160 tokens: the old group needs ~3 s to finish them, so the kill, sent right after the
# first token, always lands mid-generation even when the driver is slow to send it.
PARAMS = greedy_and_seeded(4, max_tokens=160, temperature=0.8, seed=90)


def engine_config(ckpt: str) -> dict:
    # step_timeout_s: a lost node's ranks stop answering; placement_timeout_s: a
    # rebuild that Ray tries on the dead node (not yet declared dead) retries soon.
    return {"model": {"path": ckpt, "max_model_len": 512},
            "parallel": {"executor": "ray", "tensor_parallel_size": 2, "step_timeout_s": 5.0,
                         "placement_timeout_s": 5.0, "recovery_timeout_s": 90.0},
            "scheduler": {"max_num_batched_tokens": 64}}
