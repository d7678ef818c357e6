#!/usr/bin/env python3
"""vLLM's side of bench/lora.py: runs in the vLLM CPU peer venv
(/work/shared/peers/vllm_cpu, VLLM_TARGET_DEVICE=cpu), imports nothing of
Conveyor (only bench/lib/launch.py's peer environment, standard library).
Reads the job (model dir, prompt ids, adapter dirs, output length) from a
JSON file that bench/lora.py writes, runs one side ("base" or "lora":
prompt i on adapter i % n, the same as ours) and prints one JSON line: tok/s
of the timed generate() after a warm-up, and every row's token ids.

vLLM's defaults otherwise: its CPU platform turns torch.compile off when LoRA
is enabled (CompilationMode.NONE), the base side keeps it on.
"""
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import peer_defaults  # noqa: E402  (stdlib only)

peer_defaults(quiet=True)


def main() -> int:
    """Run the side named in argv on the job file; print the JSON line."""
    side, job_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    paths = job["adapters"]
    kw = dict(enable_lora=True, max_loras=len(paths), max_lora_rank=job["rank"],
              max_cpu_loras=len(paths)) if side == "lora" else {}
    llm = LLM(model=job["model"], dtype="float32", max_model_len=2048, skip_tokenizer_init=True,
              gpu_memory_utilization=0.5, max_num_seqs=len(job["prompts"]), enable_prefix_caching=False,
              **kw)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    loras = None
    if side == "lora":
        loras = [LoRARequest(f"a{i % len(paths)}", i % len(paths) + 1, paths[i % len(paths)])
                 for i in range(len(prompts))]
    sp = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True, detokenize=False)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, warm, use_tqdm=False, lora_request=loras)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    gen_s = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(len(t) for t in tokens)
    print(json.dumps(dict(side=side, gen_s=gen_s, tok_s=n_out / gen_s, tokens=tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
