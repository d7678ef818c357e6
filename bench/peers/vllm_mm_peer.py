"""vLLM's CPU build on bench/multimodal.py's image workloads: run with the PEER venv.

The same checkpoint, prompts and images as our side (bench/multimodal.py's
``prompts`` and ``images``, imported from there): a warm-up, then the
distinct workload (every request its own image) and the repeated one (one
image in every request), each timed as one ``generate`` call, as our side
does: a second call would find the first one's images in vLLM's processor
and encoder caches. fp32, greedy, ``ignore_eos``, prefix caching off as on our side.
Prints one JSON line: per workload wall, images/s, output tok/s and the tokens.

vLLM's llava module imports torchvision. The registry's wheel is a CUDA build
that imports only with PEER_TORCHVISION_STUB=1 (bench/peers/peer_site). It
lives outside the peer venv, because `vllm bench serve` imports torchvision
when it is there and would break:
  /tmp/vllmpeer/bin/pip install --no-deps --target /tmp/vllmpeer_torchvision torchvision==0.28.0
bench/multimodal.py --vllm puts both on PYTHONPATH (VLLM_PEER_TORCHVISION
names another directory).
"""
import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for p in (REPO, os.path.join(REPO, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench.lib.launch import peer_defaults  # noqa: E402  (stdlib only)

peer_defaults(quiet=True)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    return ap.parse_args()


def _timed(llm, batch, sp) -> dict:
    t = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n, out = len(batch), len(tokens[0])
    return {"wall_s": round(wall, 3), "images_per_s": round(n / wall, 2),
            "output_tok_per_s": round(n * out / wall, 1), "tokens": tokens}


def main() -> None:
    a = _args()
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # the CUDA wheel without the stub, or none installed
        raise SystemExit(f"the peer cannot import torchvision ({type(e).__name__}: {e}); install it with "
                         "`/tmp/vllmpeer/bin/pip install --no-deps --target /tmp/vllmpeer_torchvision "
                         "torchvision==0.28.0` and run through bench/multimodal.py --vllm") from e
    import multimodal as mm
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype="float32", max_model_len=1024, enforce_eager=True,
              limit_mm_per_prompt={"image": 1}, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False,
              max_num_batched_tokens=a.max_num_batched_tokens)
    sp = SamplingParams(max_tokens=a.output, temperature=0.0, ignore_eos=True)
    llm.generate(mm.prompts(2, mm.images(2, 9), 9), SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    result = {"distinct": _timed(llm, mm.prompts(a.requests, mm.images(a.requests, 1), 1), sp),
              "repeated": _timed(llm, mm.prompts(a.requests, mm.images(1, 2), 2), sp)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
