"""llama.cpp's side of bench/llamacpp.py, run by the llama.cpp peer venv's Python
(bench/peers/llamacpp/README.md): stdlib, numpy, llama_cpp, sentencepiece; nothing
from the repository.

  tokenizer DIR     write DIR/tokenizer.model, a small SentencePiece model: the bench
                    checkpoints have no tokenizer and llama.cpp's converter needs one (it
                    pads the vocabulary to config.json's vocab_size with [PADn] tokens;
                    the bench feeds token ids, so the text side never matters).
  run GGUF PROMPTS  batch-1 decode and prefill of one GGUF file on PROMPTS (a JSON file:
                    {"decode": [ids], "prefill": [[ids], ...], "warm": [ids]}); prints one
                    JSON line.

Greedy is the argmax of the last position's logits (llama_get_logits_ith(-1)), the
same rule as temperature 0 on our side; EOS is never checked (ignore_eos).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type: GGML_TYPE_F32, GGML_TYPE_F16


def write_tokenizer(model_dir: str) -> str:
    """A deterministic ~100-piece BPE SentencePiece model with the checkpoint's
    unk/bos/eos ids, trained on generated text."""
    import sentencepiece as spm

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    bos, eos = int(cfg.get("bos_token_id", 1)), int(cfg.get("eos_token_id", 2))
    unk = next(i for i in range(3) if i not in (bos, eos))
    words = ["alpha", "beta", "gamma", "delta", "token", "engine", "batch", "decode", "prefill", "cache"]
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(200)]
    prefix = os.path.join(model_dir, "tokenizer")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=100,
                                   model_type="bpe", character_coverage=1.0, unk_id=unk, bos_id=bos,
                                   eos_id=eos, pad_id=-1, hard_vocab_limit=False, minloglevel=2)
    os.remove(prefix + ".vocab")
    return prefix + ".model"


def _rss_mib() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = round(int(line.split()[1]) / 1024, 1)
    return {"rss_mib": out.get("VmRSS", 0.0), "peak_rss_mib": out.get("VmHWM", 0.0)}


def _no_extra_bufts(llama_cpp) -> None:  # noqa: ANN001
    """Load models without ggml's extra buffer types (AMX, weight repacking): Llama()
    takes its model parameters from llama_model_default_params and has no argument for it."""
    default = llama_cpp.llama_model_default_params

    def params():  # noqa: ANN202
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params


def run(gguf: str, prompts: dict, threads: int, decode_tokens: int, flash_attn: bool, extra_bufts: bool,
        kv_type: str = "f16", decode_repeats: int = 1) -> dict:
    import numpy as np
    from llama_cpp import Llama, llama_cpp

    if not extra_bufts:
        _no_extra_bufts(llama_cpp)

    n_ctx = max(len(p) for p in [prompts["decode"], prompts["warm"], *prompts["prefill"]]) + decode_tokens + 16
    t = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=False, flash_attn=flash_attn, verbose=False,
                type_k=KV_TYPES[kv_type], type_v=KV_TYPES[kv_type])
    load_s = time.perf_counter() - t
    n_vocab = llm.n_vocab()
    ctx = llm._ctx.ctx

    def greedy() -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
        return int(row.argmax())

    def first_token(ids: list[int]) -> tuple[int, float]:
        llm.reset()  # the next eval drops every cached position
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = greedy()
        return tok, time.perf_counter() - t0

    def generate(ids: list[int], n: int) -> tuple[list[int], float, float]:
        tok, ttft = first_token(ids)
        out = [tok]
        t1 = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([tok])
            tok = greedy()
            out.append(tok)
        return out, ttft, time.perf_counter() - t1

    generate(prompts["warm"], 4)  # first-call costs (thread pool, graph allocation) outside the timing
    runs = [generate(prompts["decode"], decode_tokens) for _ in range(decode_repeats)]
    tokens, ttft = runs[0][0], statistics.median(r[1] for r in runs)
    decode_s = statistics.median(r[2] for r in runs)
    prefill = [first_token(p)[1] for p in prompts["prefill"]]
    return {"engine": "llama.cpp", "gguf": os.path.basename(gguf), "load_s": round(load_s, 2),
            "decode_tokens": tokens, "decode_ttft_s": round(ttft, 4), "decode_s": round(decode_s, 4),
            "decode_tok_s": round((decode_tokens - 1) / decode_s, 2), "prefill_s": [round(x, 4) for x in prefill],
            "decode_s_all": [round(r[2], 4) for r in runs], "flash_attn": flash_attn, "extra_bufts": extra_bufts,
            "kv_type": kv_type, "threads": threads, **_rss_mib()}


def main(argv: list[str] | None = None) -> int:
    """tokenizer DIR | run GGUF PROMPTS [--threads N --decode-tokens N --flash-attn on|off]."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tk = sub.add_parser("tokenizer")
    tk.add_argument("model_dir")
    r = sub.add_parser("run")
    r.add_argument("gguf")
    r.add_argument("prompts")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--decode-tokens", type=int, default=128)
    r.add_argument("--decode-repeats", type=int, default=1, help="decode runs; the median counts")
    r.add_argument("--flash-attn", default="on", choices=("on", "off"))
    r.add_argument("--kv-type", default="f16", choices=tuple(KV_TYPES), help="the KV cache's type (llama.cpp: f16)")
    r.add_argument("--extra-bufts", default="on", choices=("on", "off"),
                   help="off: no AMX or repacked weights (llama.cpp 0.3.36's AMX q8_0 matmul segfaults on "
                        "multi-token batches on an AMX Xeon, upstream issue 20824)")
    a = ap.parse_args(argv)
    if a.cmd == "tokenizer":
        print(write_tokenizer(a.model_dir))
        return 0
    with open(a.prompts) as f:
        prompts = json.load(f)
    print(json.dumps(run(a.gguf, prompts, a.threads, a.decode_tokens, a.flash_attn == "on",
                         a.extra_bufts == "on", a.kv_type, a.decode_repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
