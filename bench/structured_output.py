#!/usr/bin/env python3
"""Structured-output throughput: one workload at 0%, 50% and 100% structured
requests on the same engine, and the same workload on vLLM's CPU build.

Workload (identical for both engines): a random-weight fp32 ~30M Llama with the
bench's shape but a 512-token vocab and the demo tokenizer (trained on the spot,
so both engines can compile grammars), `--num-prompts` prompts of 16..64 random
token ids, greedy. Structured requests carry one of four bounded JSON schemas
(an array of records, nested objects, enums, patterns; each language finite).
A fraction f structures every 1/f-th request.

Same work on both engines: a reference run of ours (100% structured,
max_tokens 512, every output ends by its grammar) fixes each request's length
L_i; every later run, on either engine and at every fraction, gives request i
max_tokens = L_i with ignore_eos, so every row generates exactly L_i tokens
(checked: the report's `tokens` column must be equal everywhere). A peer output
that would run past ours (it loops, or writes a longer document) is cut at L_i;
one whose grammar ends earlier continues unconstrained to L_i (vLLM applies no
mask after its grammar terminates). Validity is counted per engine: a
structured output is `valid` when the first JSON document of its text parses
and validates against its schema (jsonschema), and `same` counts the rows whose
tokens equal ours.

Noise: runs on the 2-core VM swing by +-20% between processes, so every
(engine, fraction) runs in `--rounds` fresh processes, interleaved round-robin,
and the report gives best and median tok/s. `--json` accumulates runs across
invocations (the reference lengths are kept in it), so a long comparison can be
split into short runs: `--sides ours --fracs 0,1`, then `--sides vllm --fracs 1`.

The peer (bench/peers/structured_output_peer.py) runs in its own venv
(../shared/peers/vllm_cpu), on both cores (VLLM_CPU_OMP_THREADS_BIND=0-1,
VLLM_CPU_NUM_OF_RESERVED_CPU=0), with the structured-output backend its default ("auto") picks for these schemas,
xgrammar, named explicitly because only then does vLLM accept
`disable_any_whitespace`: compact JSON, the language our JSON grammar uses
(with "auto" the random model loops in whitespace until max_tokens).
Ours also reports the bitmask time per structured row per step (µs) and the
grammar compile ms p50/p99.

Usage:
  .venv/bin/python bench/structured_output.py --rounds 3 --json bench/out/structured_output.json
  .venv/bin/python bench/structured_output.py --sides ours --fracs 0,1 --rounds 3 --json J  # split
  .venv/bin/python bench/structured_output.py --sides ours --num-prompts 16 --rounds 1      # quick
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import PEERS, peer_env, peer_python  # noqa: E402
from bench.lib.models import SPECS  # noqa: E402
from bench.lib.models import model_dir as bench_model  # noqa: E402
from bench.lib.stats import percentile  # noqa: E402

MODEL_DIR = SPECS["30m_v512"].default_dir
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


def make_workload(n: int, seed: int, frac: float, lengths: list[int] | None = None) -> list[dict]:
    """lengths: each request's max_tokens (with ignore_eos); None only for the
    reference run, whose structured requests end by their grammar."""
    import random

    rng = random.Random(seed)
    every = round(1 / frac) if frac > 0 else 0
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, 512) for _ in range(rng.randint(16, 64))]
        schema = SCHEMAS[i % len(SCHEMAS)] if every and i % every == 0 else None
        out.append({"prompt": prompt, "schema": schema, "len": lengths[i] if lengths else None})
    return out


def _max_tokens(w: dict, default: int) -> dict:
    """Sampling kwargs shared by both engines: a fixed length L_i when known."""
    if w["len"] is not None:
        return {"max_tokens": w["len"], "ignore_eos": True}
    return {"max_tokens": 512} if w["schema"] is not None else {"max_tokens": default, "ignore_eos": True}


# ---- sides (each in a fresh process) ---------------------------------------------------

def run_ours(a: argparse.Namespace, work: list[dict]) -> dict:
    """Our side: the workload through LLM, best of --repeats; bitmask and compile times."""
    import torch

    torch.set_num_threads(2)
    from conveyor.engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model=a.model, max_model_len=1024, enable_prefix_caching=False)
    sps = [SamplingParams(temperature=0.0, **_max_tokens(w, a.output_len),
                          structured_outputs=None if w["schema"] is None
                          else StructuredOutputsParams(json=w["schema"]))
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
               compile_ms_p50=round(percentile(compile_ms, 50), 2),
               compile_ms_p99=round(percentile(compile_ms, 99), 2))
    llm.shutdown()
    return res


def _first_doc_valid(text: str, schema: dict) -> bool:
    """The text's first JSON document parses and validates against the schema
    (what follows it, in a peer row padded past its grammar's end, is ignored)."""
    import jsonschema

    try:
        doc, _ = json.JSONDecoder().raw_decode(text)
        jsonschema.validate(doc, schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _summary(side: str, outs: list[Any], wall: float, work: list[dict]) -> dict:
    """A side's result: tok/s, validity against the schemas, token digests."""
    ids = [list(o.outputs[0].token_ids) for o in outs]
    structured = [i for i, w in enumerate(work) if w["schema"] is not None]
    valid = sum(_first_doc_valid(outs[i].outputs[0].text, work[i]["schema"]) for i in structured)
    ntok = sum(map(len, ids))
    return {"side": side, "wall_s": round(wall, 3), "output_tokens": ntok,
            "tok_per_s": round(ntok / wall, 1), "structured": len(structured),
            "structured_valid": valid,
            "ended_by_grammar": sum(outs[i].outputs[0].finish_reason == "stop" for i in structured),
            "ids_sha": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12],
            "row_sha": [hashlib.sha256(json.dumps(r).encode()).hexdigest()[:8] for r in ids],
            "lengths": list(map(len, ids))}


# ---- driver ----------------------------------------------------------------------------

def _side(side: str, a: argparse.Namespace, frac: float, lengths: list[int] | None) -> dict:
    """One (engine, fraction) run in a fresh process: ours in this venv, vLLM's
    in the peer's (bench/peers/structured_output_peer.py, both cores)."""
    if side == "ours":
        argv, env = [sys.executable, os.path.abspath(__file__)], dict(os.environ)
    else:
        argv = [peer_python(), os.path.join(PEERS, "structured_output_peer.py")]
        env = {**os.environ, **peer_env(bind="0-1", quiet=True)}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [*argv, "--side", side, "--frac", str(frac), "--result", out.name,
               "--lengths", json.dumps(lengths),
               "--model", a.model, "--num-prompts", str(a.num_prompts), "--output-len",
               str(a.output_len), "--repeats", str(a.repeats), "--seed", str(a.seed)]
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
        res = json.load(open(out.name))
    res.update(frac=frac, at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (the private ones carry a side process's job)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=MODEL_DIR)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=96, help=argparse.SUPPRESS)
    p.add_argument("--sides", default="ours,vllm", help="comma list of ours, vllm")
    p.add_argument("--fracs", default="0,0.5,1", help="comma list of structured fractions")
    p.add_argument("--rounds", type=int, default=3,
                   help="fresh processes per (engine, fraction), interleaved")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per process (best kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="accumulate runs (and the reference) here")
    p.add_argument("--side", choices=("ours", "vllm"), help=argparse.SUPPRESS)
    p.add_argument("--frac", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--lengths", default="null", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _load(a: argparse.Namespace) -> dict:
    """The accumulated file, if it was made for this workload (else a fresh one)."""
    key = {"model": os.path.abspath(a.model), "num_prompts": a.num_prompts, "seed": a.seed}
    if a.json and os.path.isfile(a.json):
        with open(a.json) as f:
            db = json.load(f)
        if db.get("key") == key:
            return db
    return {"key": key, "reference": None, "runs": []}


def report(db: dict) -> None:
    """The markdown table of every (engine, fraction) and ours against vLLM."""
    ref = db["reference"]
    runs = db["runs"]
    print(f"\n{db['key']['num_prompts']} prompts of 16-64 tokens, greedy; request i generates "
          f"exactly L_i tokens (ours' structured length, ignore_eos) on every engine and fraction; "
          f"reference {ref['ids_sha']} ({ref['output_tokens']} tokens)")
    print("| engine | structured | runs | best tok/s | median tok/s | median vs its 0% | tokens "
          "| valid | same tokens as ours | extra |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["side"], r["frac"]), []).append(r)
    for (side, frac), rs in sorted(groups.items()):
        tps = sorted(r["tok_per_s"] for r in rs)
        med = statistics.median(tps)
        base = groups.get((side, 0.0))
        rel = f"{med / statistics.median(r['tok_per_s'] for r in base):.2f}x" if base else "-"
        last = rs[-1]
        ours = groups.get(("ours", frac))
        same = (sum(x == y for x, y in zip(last["row_sha"], ours[-1]["row_sha"]))
                if ours and side != "ours" else len(last["row_sha"]))
        extra = (f"bitmask {statistics.median(r['bitmask_us_per_row'] for r in rs):.1f} µs/row/step, "
                 f"compile p50 {last['compile_ms_p50']} p99 {last['compile_ms_p99']} ms"
                 if side == "ours" and frac > 0 else "")
        toks = "/".join(sorted({str(r["output_tokens"]) for r in rs}))
        print(f"| {side} | {int(frac * 100)}% | {len(rs)} | {tps[-1]} | {med} | {rel} | {toks} | "
              f"{last['structured_valid']}/{last['structured']} | {same}/{len(last['row_sha'])} | {extra} |")
    for frac in sorted({f for _, f in groups}):
        o, v = groups.get(("ours", frac)), groups.get(("vllm", frac))
        if o and v:
            print(f"ours / vllm at {int(frac * 100)}%: median "
                  f"{statistics.median(r['tok_per_s'] for r in o) / statistics.median(r['tok_per_s'] for r in v):.2f}"
                  "x, "
                  f"best {max(r['tok_per_s'] for r in o) / max(r['tok_per_s'] for r in v):.2f}x")


def side_main(a: argparse.Namespace, runner: Any) -> int:
    """A side's process (ours here, vLLM's in the peer script): run, write the result."""
    work = make_workload(a.num_prompts, a.seed, a.frac, json.loads(a.lengths))
    res = runner(a, work)
    with open(a.result, "w") as f:
        json.dump(res, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    """A side's process, or the reference run then --rounds interleaved rounds; the report."""
    a = parse_args(argv)
    if a.side is not None:
        return side_main(a, run_ours)
    bench_model("30m_v512", a.model)
    db = _load(a)
    if db["reference"] is None:
        # Ours at 100%, every output ended by its grammar: its lengths become
        # every request's fixed length everywhere after.
        ref = _side("ours", a, 1.0, None)
        if ref["ended_by_grammar"] != ref["structured"]:
            raise SystemExit("reference run: not every structured output ended by its grammar")
        db["reference"] = {k: ref[k] for k in ("lengths", "ids_sha", "output_tokens", "row_sha")}
    lengths = db["reference"]["lengths"]
    sides = a.sides.split(",")
    fracs = [float(f) for f in a.fracs.split(",")]
    for rnd in range(a.rounds):
        combos = [(s, f) for s in sides for f in fracs]
        k = rnd % len(combos)  # rotate the order so no combination always runs first
        for side, frac in combos[k:] + combos[:k]:
            db["runs"].append(_side(side, a, frac, lengths))
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(db, f)
    report(db)
    return 0


if __name__ == "__main__":
    sys.exit(main())
