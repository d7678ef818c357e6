#!/usr/bin/env python3
"""bench/spec_decode.py's peer side: the same runs with vLLM's CPU build
(run with the peer venv's python; see ../shared/peers/vllm_cpu/README.md).

One long-lived process per speculative config serves every (workload, batch)
run (bench/lib/side_process.py's protocol; a vLLM engine takes about a
minute to start here): the config JSON holds `model_dir`, `spec`,
`max_num_seqs`, `gpu_memory_utilization` and `runs` (each: prompts,
output_len, temperature, seed). Results have the same fields as ours.

  PEER_PY bench/peers/spec_decode_peer.py _serve CFG_JSON
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import peer_defaults  # noqa: E402  (stdlib only)
from bench.lib.side_process import serve_loop, spec_result  # noqa: E402

peer_defaults(bind="0-1")


def _counters(llm: Any) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter

    return {m.name: float(m.value) for m in llm.get_metrics() if isinstance(m, Counter)}


def serve(cfg: dict[str, Any]) -> None:
    """Warm up every run, then time one generate() of run i per request line."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {"speculative_config": cfg["spec"]} if cfg["spec"] else {}
    llm = LLM(model=cfg["model_dir"], skip_tokenizer_init=True, dtype="float32",
              gpu_memory_utilization=cfg.get("gpu_memory_utilization", 0.5),
              max_num_seqs=cfg["max_num_seqs"], max_model_len=2048, disable_log_stats=False, **kw)
    runs = [([TokensPrompt(prompt_token_ids=p) for p in r["prompts"]],
             SamplingParams(max_tokens=r["output_len"], temperature=r["temperature"],
                            ignore_eos=True, seed=r.get("seed"), detokenize=False))
            for r in cfg["runs"]]
    for prompts, sp in runs:
        llm.generate(prompts, sp, use_tqdm=False)

    def call(i: int, side: str) -> dict[str, Any]:
        prompts, sp = runs[i]
        before = _counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = _counters(llm)
        return spec_result(wall, outs, {k: after[k] - before.get(k, 0.0) for k in after}, "vllm:")

    serve_loop(call)


if __name__ == "__main__":  # argv: _serve CFG_JSON (LLM spawns its engine process)
    with open(sys.argv[2]) as f:
        serve(json.load(f))
