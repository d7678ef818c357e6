#!/usr/bin/env python3
"""Weight-only int8 (``quantization: int8``) against fp32, end to end.

The same prompts through ``LLM`` twice (fp32, then int8 weights), greedy, with
the sampled tokens' logprobs: greedy agreement (share of requests whose whole
output is identical, and share of tokens before the first divergence), the
sampled tokens' |logprob difference| on the agreeing prefix, and batch-1
decode tok/s of each. The checkpoint is the benches' random 30M Llama
(bench/lib/models.py, "30m") unless ``--model-dir`` names another.

Usage:
  .venv/bin/python bench/int8_accuracy.py --prompts 16 --tokens 32
"""
from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.models import LLAMA_30M, model_dir  # noqa: E402
from bench.lib.prompts import make_prompts  # noqa: E402
from bench.lib.stats import percentile  # noqa: E402


def _run(model_dir: str, prompts: list[list[int]], tokens: int, quant: str | None) -> tuple[list, float]:
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(model=model_dir, quantization=quant, attention_backend="cpu")
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
    one = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate([prompts[0]], one, use_tqdm=False)
    tok_s = tokens / (time.perf_counter() - t0)
    llm.shutdown()
    return [(list(o.token_ids), o.logprobs) for o in outs], tok_s


def main() -> None:
    """fp32 then int8 on the same prompts: agreement, logprob error, batch-1 tok/s."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args()
    path = a.model_dir or model_dir("30m")
    prompts = make_prompts(a.prompts, 0, LLAMA_30M["vocab_size"], 16, 128)
    ref, ref_tps = _run(path, prompts, a.tokens, None)
    q, q_tps = _run(path, prompts, a.tokens, "int8")
    same = prefix = total = 0
    errs: list[float] = []
    for (rt, rl), (qt, ql) in zip(ref, q):
        n = next((i for i, (x, y) in enumerate(zip(rt, qt)) if x != y), len(rt))
        same += n == len(rt)
        prefix, total = prefix + n, total + len(rt)
        errs += [abs(rl[i][rt[i]] - ql[i][qt[i]]) for i in range(n)
                 if rl and ql and rt[i] in rl[i] and qt[i] in ql[i]]
    errs.sort()
    print(f"{path}: {len(prompts)} prompts x {a.tokens} tokens, greedy")
    print(f"  identical outputs {same}/{len(prompts)}; tokens before first divergence {prefix}/{total} "
          f"({100 * prefix / total:.1f}%)")
    if errs:
        print(f"  |logprob int8 - fp32| on the agreeing prefix: mean {sum(errs) / len(errs):.2e}, "
              f"p99 {percentile(errs, 99):.2e}, max {errs[-1]:.2e}")
    print(f"  batch-1 decode: fp32 {ref_tps:.1f} tok/s, int8 {q_tps:.1f} tok/s ({q_tps / ref_tps:.2f}x)")


if __name__ == "__main__":
    main()
