#!/usr/bin/env python3
"""Batch-1 decode and prefill, Conveyor against llama.cpp, side by side in one run.

The checkpoints are bench/lib/models.py's random 30M Llama, Qwen2-0.5B- and
Llama-3.2-1B-shaped models. Each is converted to GGUF (f32, bf16, q8_0) by
llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python sdist,
run in the peer venv; bench/peers/llamacpp/README.md), from a staging folder that
links the checkpoint's files and adds a small SentencePiece tokenizer.model (the
bench checkpoints have none; the converter pads the vocabulary to vocab_size).
GGUF files are kept beside the checkpoints and rebuilt when the checkpoint changes.

Pairs (the same checkpoint, the same cores, ``--threads`` on both sides):
  f32   llama.cpp f32 GGUF   vs ours dtype float32
  bf16  llama.cpp bf16 GGUF  vs ours dtype bfloat16
  q8_0  llama.cpp q8_0 GGUF  vs ours float32 + ``quantization: int8`` (weight-only
        int8, fp32 math; q8_0 also quantizes the activations: tokens not comparable)

Each (model, dtype, engine) runs in a fresh process (engines alternate which goes
first): a warm-up generate, then
  decode   a ``--prompt-len``-token prompt, then ``--decode-tokens`` greedy tokens
           (ignore_eos); tok/s over the tokens after the first. Ours: (N - 1) /
           (T(N tokens) - T(1 token)) of two generate calls; llama.cpp: the same
           interval timed in its loop (llama_cpp.Llama.eval + argmax of the logits).
  prefill  ``--prefill-repeats`` distinct ``--prefill-len``-token prompts, one output
           token each (time to first token); prefill tok/s = len / median TTFT.
Prefix caching is off on our side; llama.cpp's KV cache is cleared per prompt.
Decode is the median of ``--decode-repeats`` runs, prefill of ``--prefill-repeats``.
llama.cpp runs with n_batch = n_ubatch = 512 and, per GGUF type: f32 with an f32 KV
cache and no flash attention (f32 math, as ours), bf16 and q8_0 with its defaults
(f16 KV cache, flash attention); q8_0 without the AMX buffer type (EXTRA_BUFTS).
Tokens are compared where the dtype makes them comparable (f32: the same math up to
rounding); the others are reported too, marked not comparable. ``--profile`` adds a
torch.profiler summary of our decode step per row to the JSON.

Usage:
  flock /tmp/conveyor_heavy.lock .venv/bin/python bench/llamacpp.py
  .venv/bin/python bench/llamacpp.py --models 30m --dtypes f32 --decode-tokens 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import PEERS  # noqa: E402
from bench.lib.meta import emit_report, hardware_info, run_meta  # noqa: E402
from bench.lib.models import MODELS_ROOT, OUT, SPECS  # noqa: E402
from bench.lib.models import model_dir as bench_model_dir  # noqa: E402
from bench.lib.prompts import make_prompts  # noqa: E402

PEER_VENV = os.environ.get("LLAMACPP_PEER", "/tmp/llamacpppeer")
PEER_PY = os.path.join(PEER_VENV, "bin", "python")
CONVERTER = os.path.join(PEER_VENV, "convert", "convert_hf_to_gguf.py")
PEER_SCRIPT = os.path.join(PEERS, "llamacpp_peer.py")
GGUF_ROOT = os.path.join(MODELS_ROOT, "gguf")
# our side of each GGUF type: (dtype, quantization)
OURS = {"f32": ("float32", None), "bf16": ("bfloat16", None), "q8_0": ("float32", "int8")}
COMPARABLE = {"f32"}
# llama.cpp's extra buffer types (AMX tiles, repacked weights) per GGUF type. On x86 only the
# quantized types use them, and in this llama.cpp the AMX q8_0 matmul segfaults on any batch of
# more than one token (an AMX Xeon, 2026-12-07; upstream issue 20824 is open), so q8_0 runs on
# ggml's AVX-512 VNNI dot products, as on every x86 CPU without AMX (x86 has no q8_0 repack).
EXTRA_BUFTS = {"f32": "on", "bf16": "on", "q8_0": "off"}
# llama.cpp's attention per row. f32: f32 math as ours (f32 KV cache, no flash attention: its CPU
# flash attention rounds through f16 whatever the cache type; with it the first logits are off
# HF's by up to 0.04, without it by 5e-5, and greedy tokens part at the first near-tie).
# Elsewhere its defaults: f16 KV cache, flash attention (its CLI's auto turns it on for the CPU).
KV_TYPE = {"f32": "f32", "bf16": "f16", "q8_0": "f16"}
FLASH_ATTN = {"f32": "off", "bf16": "on", "q8_0": "on"}
# decode tokens per model unless --decode-tokens: the 1B f32 runs take ~8 tok/s here
DECODE_TOKENS = {"30m": 128, "0.5b": 64, "1b": 32}
_CKPT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def _ckpt_stamp(ckpt: str) -> str:
    """What a GGUF was built from: the checkpoint's bench_spec.json (or config.json)."""
    for name in ("bench_spec.json", "config.json"):
        p = os.path.join(ckpt, name)
        if os.path.isfile(p):
            with open(p) as f:
                return f.read()
    raise FileNotFoundError(f"{ckpt} has no config.json")


def _staging(ckpt: str, name: str) -> str:
    """A folder the converter reads: the checkpoint's files linked, plus tokenizer.model."""
    stage = os.path.join(GGUF_ROOT, f"{name}_hf")
    os.makedirs(stage, exist_ok=True)
    for f in os.listdir(ckpt):
        if f in _CKPT_FILES or (f.startswith("model-") and f.endswith(".safetensors")):
            dst = os.path.join(stage, f)
            if os.path.lexists(dst):
                os.remove(dst)
            os.symlink(os.path.join(os.path.abspath(ckpt), f), dst)
    if not os.path.isfile(os.path.join(stage, "tokenizer.model")):
        _check([PEER_PY, PEER_SCRIPT, "tokenizer", stage], "tokenizer.model")
    return stage


def _check(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (rc {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return proc.stdout


def gguf_path(name: str, ckpt: str, outtype: str) -> str:
    """The GGUF of ``ckpt`` in ``outtype``, converted by llama.cpp's converter unless
    the one there was converted from the same checkpoint spec."""
    out = os.path.join(GGUF_ROOT, f"{name}-{outtype}.gguf")
    stamp_file = out + ".from.json"
    stamp = _ckpt_stamp(ckpt)
    if os.path.isfile(out) and os.path.isfile(stamp_file):
        with open(stamp_file) as f:
            if f.read() == stamp:
                return out
    stage = _staging(ckpt, name)
    t = time.perf_counter()
    _check([PEER_PY, CONVERTER, stage, "--outfile", out, "--outtype", outtype], f"converting {name} to {outtype}")
    with open(stamp_file, "w") as f:
        f.write(stamp)
    print(f"  converted {name} -> {os.path.basename(out)} "
          f"({os.path.getsize(out) / 2**20:.0f} MiB, {time.perf_counter() - t:.0f} s)", flush=True)
    return out


def run_ours_inline(job: dict) -> dict:
    """Our side, in a fresh process: the same workload as llamacpp_peer.run."""
    import torch

    torch.set_num_threads(job["threads"])
    from conveyor.engine import LLM, SamplingParams

    with open(job["prompts"]) as f:
        prompts = json.load(f)
    n = job["decode_tokens"]
    t = time.perf_counter()
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], quantization=job["quantization"], max_num_seqs=1,
              enable_prefix_caching=False, max_model_len=job["max_model_len"])
    load_s = time.perf_counter() - t

    def gen(ids: list[int], k: int) -> tuple[list[int], float]:
        sp = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([ids], sp, use_tqdm=False)
        return list(out[0].outputs[0].token_ids), time.perf_counter() - t0

    gen(prompts["warm"], 4)
    t1 = statistics.median(gen(prompts["decode"], 1)[1] for _ in range(job["decode_repeats"]))
    runs = [gen(prompts["decode"], n) for _ in range(job["decode_repeats"])]
    tokens, tn = runs[0][0], statistics.median(r[1] for r in runs)
    prefill = [gen(p, 1)[1] for p in prompts["prefill"]]
    prof = _profile_decode(gen, prompts["decode"], n) if job.get("profile") else None
    llm.shutdown()
    rss = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                rss[line.split(":")[0]] = round(int(line.split()[1]) / 1024, 1)
    return {"engine": "conveyor", "load_s": round(load_s, 2), "decode_tokens": tokens, "decode_ttft_s": round(t1, 4),
            "decode_s": round(tn - t1, 4), "decode_tok_s": round((n - 1) / (tn - t1), 2),
            "decode_s_all": [round(r[1] - t1, 4) for r in runs], "prefill_s": [round(x, 4) for x in prefill],
            "threads": job["threads"],
            "rss_mib": rss.get("VmRSS", 0.0), "peak_rss_mib": rss.get("VmHWM", 0.0),
            **({"profile": prof} if prof else {})}


def _profile_decode(gen, ids: list[int], n: int) -> dict:  # noqa: ANN001
    """torch.profiler over one N-token generate: per decode step, the wall time, the time
    inside torch ops (self CPU time summed; the rest is Python: engine loop, scheduler,
    sampler glue) and the ops that take it."""
    from torch.profiler import ProfilerActivity, profile

    _, t1 = gen(ids, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, tn = gen(ids, n)
    ev = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    steps = n - 1
    top = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]
    return {"wall_ms_per_step": round((tn - t1) * 1e3 / steps, 3),
            "ops_ms_per_step": round(sum(e.self_cpu_time_total for e in ev) / 1e3 / n, 3),
            "top_ops_ms_per_step": [[e.key, round(e.self_cpu_time_total / 1e3 / n, 3), round(e.count / n, 1)]
                                    for e in top]}


def _last_json(proc: subprocess.CompletedProcess, who: str) -> dict:
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{who} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def _run_ours(job: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_ours", json.dumps(job)]
    return _last_json(subprocess.run(cmd, capture_output=True, text=True, cwd=REPO), "conveyor")


def _run_peer(job: dict) -> dict:
    cmd = [PEER_PY, PEER_SCRIPT, "run", job["gguf"], job["prompts"], "--threads", str(job["threads"]),
           "--decode-tokens", str(job["decode_tokens"]), "--flash-attn", job["flash_attn"],
           "--extra-bufts", job["extra_bufts"], "--kv-type", job["kv_type"],
           "--decode-repeats", str(job["decode_repeats"])]
    return _last_json(subprocess.run(cmd, capture_output=True, text=True), "llama.cpp")


def _summary(r: dict, prefill_len: int) -> dict:
    ttft = statistics.median(r["prefill_s"])
    return {"decode_tok_s": r["decode_tok_s"], "prefill_ttft_s": round(ttft, 4),
            "prefill_tok_s": round(prefill_len / ttft, 1)}


def _agreement(a: list[int], b: list[int]) -> dict:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return {"identical": sum(x == y for x, y in zip(a, b)), "of": min(len(a), len(b)), "first_divergence": first}


def measure(name: str, outtype: str, ckpt: str, gguf: str, prompts_file: str, args: argparse.Namespace,
            order: int) -> dict:
    """One (model, dtype) pair: each engine once in its own process, then the ratios."""
    dtype, quant = OURS[outtype]
    n = args.decode_tokens or DECODE_TOKENS.get(name, 64)
    fa = FLASH_ATTN[outtype] if args.flash_attn == "auto" else args.flash_attn
    job = dict(model_dir=ckpt, dtype=dtype, quantization=quant, gguf=gguf, prompts=prompts_file, flash_attn=fa,
               decode_tokens=n, threads=args.threads, extra_bufts=EXTRA_BUFTS[outtype],
               kv_type=KV_TYPE[outtype], decode_repeats=args.decode_repeats,
               max_model_len=max(args.prefill_len, args.prompt_len + n) + 64, profile=args.profile)
    sides = [("conveyor", _run_ours), ("llama.cpp", _run_peer)]
    runs = {}
    for who, fn in (sides if order % 2 == 0 else sides[::-1]):
        runs[who] = fn(job)
    ours, peer = (_summary(runs[w], args.prefill_len) for w in ("conveyor", "llama.cpp"))
    return {"model": name, "gguf": outtype, "ours_dtype": dtype, "ours_quantization": quant, "decode_tokens": n,
            "conveyor": ours, "llama.cpp": peer,
            "decode_ratio": round(ours["decode_tok_s"] / peer["decode_tok_s"], 3),
            "prefill_ratio": round(ours["prefill_tok_s"] / peer["prefill_tok_s"], 3),
            "tokens": {**_agreement(runs["conveyor"]["decode_tokens"], runs["llama.cpp"]["decode_tokens"]),
                       "comparable": outtype in COMPARABLE},
            "runs": runs}


def _table(rows: list[dict], prefill_len: int) -> str:
    head = (f"{'model':6s} {'dtype':5s} {'decode ours':>11s} {'llama.cpp':>9s} {'ratio':>6s}   "
            f"{'prefill' + str(prefill_len) + ' ours':>15s} {'llama.cpp':>9s} {'ratio':>6s}   tokens identical")
    lines = [head]
    for r in rows:
        t = r["tokens"]
        tok = f"{t['identical']}/{t['of']}" + (f" (first diff {t['first_divergence']})"
                                               if t["first_divergence"] is not None else "")
        lines.append(f"{r['model']:6s} {r['gguf']:5s} {r['conveyor']['decode_tok_s']:11.2f} "
                     f"{r['llama.cpp']['decode_tok_s']:9.2f} {r['decode_ratio']:5.2f}x   "
                     f"{r['conveyor']['prefill_tok_s']:15.1f} {r['llama.cpp']['prefill_tok_s']:9.1f} "
                     f"{r['prefill_ratio']:5.2f}x   {tok}{'' if t['comparable'] else ' (not comparable)'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Convert, then each (model, dtype) on both engines; a table and bench/out/llamacpp.json."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="30m,0.5b,1b", help="names of bench/lib/models.py's SPECS")
    ap.add_argument("--dtypes", default="f32,bf16,q8_0", help="GGUF types: f32, bf16, q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=0, help=f"0: per model, {DECODE_TOKENS}")
    ap.add_argument("--decode-repeats", type=int, default=3, help="decode runs per process; the median counts")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--flash-attn", default="auto", choices=("auto", "on", "off"),
                    help=f"llama.cpp's flash attention; auto: per GGUF type, {FLASH_ATTN}")
    ap.add_argument("--profile", action="store_true",
                    help="also profile our decode (torch.profiler, one more generate per process): in the JSON")
    ap.add_argument("--json", default=os.path.join(OUT, "llamacpp.json"))
    ap.add_argument("--_ours", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._ours is not None:
        print(json.dumps(run_ours_inline(json.loads(args._ours))))
        return 0
    if not (os.path.exists(PEER_PY) and os.path.exists(CONVERTER)):
        print(f"no llama.cpp peer at {PEER_VENV}: run bench/peers/llamacpp/make_venv.sh", file=sys.stderr)
        return 2
    dtypes = args.dtypes.split(",")
    if unknown := [d for d in dtypes if d not in OURS]:
        raise SystemExit(f"unknown --dtypes {unknown}; choose from {', '.join(OURS)}")
    os.makedirs(GGUF_ROOT, exist_ok=True)
    rows: list[dict] = []
    for name in args.models.split(","):
        if name not in SPECS:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(SPECS)}")
        ckpt = bench_model_dir(name)
        vocab = SPECS[name].config["vocab_size"]
        ps = make_prompts(2 + args.prefill_repeats, 0, vocab, args.prefill_len, args.prefill_len)
        prompts = {"warm": ps[0], "decode": ps[1][:args.prompt_len], "prefill": ps[2:]}
        prompts_file = os.path.join(GGUF_ROOT, f"{name}_prompts.json")
        with open(prompts_file, "w") as f:
            json.dump(prompts, f)
        for outtype in dtypes:
            gguf = gguf_path(name, ckpt, outtype)
            r = measure(name, outtype, ckpt, gguf, prompts_file, args, len(rows))
            r["loadavg1"] = round(os.getloadavg()[0], 2)
            rows.append(r)
            print(_table([r], args.prefill_len).splitlines()[1], flush=True)
    for r in rows:  # the agreement is kept; the token lists themselves are not
        for run in r["runs"].values():
            run["decode_tokens"] = run["decode_tokens"][:16]
    report = {"meta": run_meta(hardware=hardware_info(), peer_venv=PEER_VENV), "threads": args.threads,
              "prompt_len": args.prompt_len, "prefill_len": args.prefill_len, "flash_attn": args.flash_attn,
              "results": rows}
    emit_report(report, args.json or None)
    print(_table(rows, args.prefill_len))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
