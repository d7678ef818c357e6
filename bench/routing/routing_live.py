#!/usr/bin/env python3
"""Routing benchmark, parts (b) and (c): live servers on a multi-turn chat workload.

(b) `conveyor serve` with 2 engines (parallel.data_parallel_size 2) of the
30M bench Llama, one fresh server per router policy (kv_aware, power_of_two).
(c) the peer: Ray Serve LLM over 2 vLLM CPU replicas behind its
PrefixCacheAffinityRouter (bench/peers/ray_serve_llm_app.py in the venv of
../shared/peers/vllm_cpu/README.md, "Ray Serve LLM on CPU"), on the same
workload in the same run. One server at a time, each bound to 127.0.0.1 and
stopped by its PID (bench/lib/launch.py's start/stop).

Workload: C conversations share one system prompt; turn k sends the whole
conversation so far (system, user 1, assistant 1, ..., user k) as chat
messages, so each turn's prompt extends the previous one. By default
(`--answers echo`) each assistant message is the text the server itself
streamed back for that turn, as a real chat client sends it (greedy, so each
server's answers are deterministic; servers' answers, hence their prompt
token totals, can differ slightly, so prefill is compared both absolute and as
a fraction of the server's own prompt tokens). `--answers fixed` sends
synthetic assistant text fixed by the seed instead, identical for every
server (the same prompts everywhere, but ~answer_words of every turn's new
tokens uncached under any policy). In echo mode the answers are sampled from
the tokenizer's space-led alphabetic word tokens (`allowed_token_ids`, which
both servers take; `--answer-vocab any` lifts it): the random-weight model
otherwise emits partial UTF-8 byte tokens that detokenize to U+FFFD and
re-tokenize to other ids, so the answer it generated would never match its
own text sent back (a trained model's text round-trips); word tokens
round-trip exactly. A conversation sends its next turn when
the previous answer has streamed in, plus a think time; conversations start
staggered and overlap. Streaming, greedy, `max_tokens` A with `ignore_eos`.

Per server: prompt tokens; prefill tokens computed (ours: the engines' own
counters, prefix_cache_queries - prefix_cache_hits summed over the engines'
`engine`-labelled series on /metrics; everyone: sum of prompt_tokens -
usage.prompt_tokens_details.cached_tokens, vLLM with
enable_prompt_tokens_details); hit rate = cached / prompt tokens; TTFT
p50/p90 (first streamed content token); output tok/s over the whole workload;
in echo mode, how many answers equal the first server's.

  .venv/bin/python bench/routing/routing_live.py              # kv_aware, power_of_two, ray-llm
  .venv/bin/python bench/routing/routing_live.py --servers kv_aware,power_of_two --think-s 0.5 3
  .venv/bin/python bench/routing/routing_live.py --servers ray-llm --think-s 0.5 3 --port 8410
  .venv/bin/python bench/routing/routing_live.py --answers fixed      # the fixed-answer workload

Defaults: echo mode with word-token answers, 24 conversations x 6 turns, a ~300-token
system prompt, ~64-token user messages (and fixed answers in --answers fixed), 32 tokens
out, 2 engines of 12,288 KV tokens in blocks of 32 each
(BENCHMARKS.md, "Routing live").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib import launch  # noqa: E402
from bench.lib.launch import Server  # noqa: E402
from bench.lib.meta import run_meta  # noqa: E402
from bench.lib.sse import Reply, run, stream  # noqa: E402
from bench.lib.stats import percentile  # noqa: E402

OUT = os.path.join(REPO, "bench", "out", "routing_live")
MODEL_NAME = "m30"
POLICIES = ("kv_aware", "session", "least_loaded", "power_of_two", "round_robin")
_METRIC = re.compile(r'^conveyor:prefix_cache_(queries|hits)_total\{([^}]*)\}\s+([0-9.eE+-]+)$', re.M)


# ---- the workload ------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """The multi-turn chat workload's shape (the same for every server)."""
    convs: int = 24
    turns: int = 6
    system_words: int = 50
    user_words: int = 13
    answer_words: int = 12
    max_tokens: int = 32
    think_s: float = 0.2  # think time after each answer: uniform in [think_s, think_max_s]
    think_max_s: float = 0.2
    stagger_s: float = 0.25
    seed: int = 0
    answers: str = "echo"  # "echo": send back the server's own answer; "fixed": the seed's text
    allowed_token_ids: tuple[int, ...] = ()  # echo mode's answer vocabulary; () = any token


def _words(rng: random.Random, lexicon: list[str], n: int) -> str:
    return " ".join(rng.choice(lexicon) for _ in range(n))


def conversations(w: Workload) -> tuple[str, list[list[tuple[str, str]]]]:
    """The system prompt, and per conversation its (user, assistant) turns."""
    rng = random.Random(w.seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lexicon = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(400)]
    system = "You are a helpful assistant. " + _words(rng, lexicon, w.system_words)
    convs = [[(_words(rng, lexicon, w.user_words), _words(rng, lexicon, w.answer_words))
              for _ in range(w.turns)] for _ in range(w.convs)]
    return system, convs


# ---- one request, one conversation ---------------------------------------------------------

async def chat(client: Any, body: dict[str, Any]) -> Reply:
    """One streamed chat turn (every event parsed: its content is the answer)."""
    return await stream(client, "/v1/chat/completions", body, full=True)


def _body(messages: list[dict[str, str]], w: Workload) -> dict[str, Any]:
    """A streamed greedy chat request of exactly max_tokens tokens, usage on."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": w.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if w.allowed_token_ids:
        body["allowed_token_ids"] = list(w.allowed_token_ids)
    return body


def word_token_ids(model: str) -> tuple[int, ...]:
    """Token ids that decode to a space and ASCII letters: any sequence of them
    detokenizes to text that tokenizes back to the same ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    special = set(tok.all_special_ids)
    words = []
    for i in range(len(tok)):
        s = tok.decode([i])
        if i not in special and len(s) > 1 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
            words.append(i)
    return tuple(words)


async def conversation(client: Any, system: str, turns: list[tuple[str, str]], w: Workload,
                       delay: float) -> list[Reply]:
    """The turns of one conversation, each after the previous answer and a think time."""
    await asyncio.sleep(delay)
    think = random.Random(f"{w.seed}-{delay}")  # the same think times on every server
    msgs = [{"role": "system", "content": system}]
    out = []
    for user, answer in turns:
        msgs.append({"role": "user", "content": user})
        out.append(await chat(client, _body(msgs, w)))
        # echo: what the server generated (a real client's history); a failed
        # turn falls back to the fixed text so the conversation can go on.
        sent = out[-1].text if w.answers == "echo" and out[-1].ok else answer
        msgs.append({"role": "assistant", "content": sent})
        await asyncio.sleep(think.uniform(w.think_s, max(w.think_s, w.think_max_s)))
    return out


async def run_workload(url: str, w: Workload) -> tuple[list[Reply], float]:
    """Every conversation, staggered and overlapping; the turns and the wall time."""
    import httpx

    system, convs = conversations(w)
    timeout = httpx.Timeout(300.0, read=None)
    clients = [httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=1))
               for _ in convs]
    try:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(conversation(c, system, turns, w, i * w.stagger_s)
                                      for i, (c, turns) in enumerate(zip(clients, convs))))
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.aclose()
    return [t for conv in done for t in conv], wall


async def warm_up(url: str, w: Workload) -> None:
    """A few requests unrelated to the workload (another seed: no shared prefix)."""
    import httpx

    system, convs = conversations(Workload(convs=4, turns=1, seed=w.seed + 1000))
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as c:
        await asyncio.gather(*(chat(c, _body([{"role": "system", "content": system},
                                              {"role": "user", "content": t[0][0]}], w)) for t in convs))


# ---- the servers ---------------------------------------------------------------------------

def engine_counters(url: str) -> dict[str, tuple[float, float]] | None:
    """Our engines' own prefix-cache counters: engine -> (queries, hits) in tokens."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: dict[str, list[float]] = {}
    for kind, labels, value in _METRIC.findall(text):
        eng = re.search(r'engine="([^"]*)"', labels)
        acc = out.setdefault(eng.group(1) if eng else "0", [0.0, 0.0])
        acc[0 if kind == "queries" else 1] += float(value)
    return {e: (q, h) for e, (q, h) in out.items()} if out else None


def conveyor(a: argparse.Namespace, policy: str, port: int) -> Server:
    """`conveyor serve` with --engines engines behind the ``policy`` router."""
    sets = [f"parallel.data_parallel_size={a.engines}", f"serve.router={policy}",
            f"cache.block_size={a.block_size}", f"cache.num_gpu_blocks={a.kv_tokens // a.block_size}",
            *a.conveyor_set]
    flags = launch.engine_flags(a.model, MODEL_NAME, a.max_num_seqs, a.max_model_len)
    return launch.conveyor_serve(a.config, port, flags, sets, {}, name=f"conveyor {policy}")


def ray_llm(a: argparse.Namespace, port: int) -> Server:
    """Ray Serve LLM: --engines vLLM replicas behind its PrefixCacheAffinityRouter."""
    args = ["--max-num-seqs", str(a.max_num_seqs), "--max-model-len", str(a.max_model_len),
            "--replicas", str(a.engines), "--prefix-router", "--num-blocks", str(a.kv_tokens // a.block_size),
            "--block-size", str(a.block_size), "--num-cpus", str(2 * a.engines + 2),
            "--temp-dir", "/tmp/ray_routing_peer"]
    return launch.ray_serve_llm(a.model, port, args, _peer_thread_env(), a.ray_llm_venv,
                                name="Ray Serve LLM prefix")


def _peer_thread_env() -> dict[str, str]:
    # One compute thread per vLLM replica, not pinned, like each of our engine
    # actors (torch threads = the actor's num_cpus = 1); vLLM's default would
    # pin both replicas' threads to the same core.
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


# ---- one server's run ----------------------------------------------------------------------

def measure(s: Server, a: argparse.Namespace, w: Workload) -> dict[str, Any]:
    """One server: start, warm up, the workload between two reads of its counters, stop."""
    t0 = time.monotonic()
    try:
        url = launch.start(s, a.out_dir, a.start_timeout_s if s.ready_pattern is None else a.peer_start_timeout_s)
        print(f"{s.name}: ready at {url} in {time.monotonic() - t0:.0f}s", flush=True)
        run(warm_up(url, w))
        before = engine_counters(url)
        turns, wall = run(run_workload(url, w))
        after = engine_counters(url)
    finally:
        launch.stop(s)
    return summarize(s.name, turns, wall, before, after)


def summarize(name: str, turns: list[Reply], wall: float, before: dict[str, tuple[float, float]] | None,
              after: dict[str, tuple[float, float]] | None) -> dict[str, Any]:
    """One server's row: prefill computed, hit rates, TTFT, output tok/s, its answers."""
    ok = [t for t in turns if t.ok]
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    ttft = [t.ttft * 1000 for t in ok]
    r: dict[str, Any] = {
        "server": name, "requests": len(turns), "failed": len(turns) - len(ok), "wall_s": wall,
        "prompt_tokens": prompt, "cached_tokens": cached, "prefill_computed_usage": prompt - cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "prefill_fraction": (prompt - cached) / prompt if prompt else 0.0,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
        "output_tokens": sum(t.output_tokens for t in ok),
        "output_tok_s": sum(t.output_tokens for t in ok) / wall,
        "errors": sorted({t.error for t in turns if not t.ok})[:3],
        "answers": [t.text for t in turns]}
    if before is not None and after is not None:
        per = {e: (q - before.get(e, (0.0, 0.0))[0], h - before.get(e, (0.0, 0.0))[1])
               for e, (q, h) in after.items()}
        r["engine_counters"] = per
        r["prefill_computed_engines"] = sum(q - h for q, h in per.values())
        r["hit_rate_engines"] = (sum(h for _, h in per.values()) / max(sum(q for q, _ in per.values()), 1))
    return r


def print_table(rows: list[dict[str, Any]]) -> None:
    """Every server's row, then power_of_two against kv_aware."""
    print(f"\n{'server':<24}{'ok/fail':>9}{'prompt':>8}{'prefill':>9}{'(engines)':>10}{'/prompt':>8}"
          f"{'hit':>7}{'(engines)':>10}{'TTFT p50':>10}{'p90 ms':>8}{'out tok/s':>11}{'same ans':>10}")
    first = rows[0]["answers"] if rows else []
    for r in rows:
        pe = r.get("prefill_computed_engines")
        he = r.get("hit_rate_engines")
        same = sum(a == b for a, b in zip(r["answers"], first))
        print(f"{r['server']:<24}{r['requests'] - r['failed']:>5}/{r['failed']:<3}{r['prompt_tokens']:>8}"
              f"{r['prefill_computed_usage']:>9}{'-' if pe is None else f'{pe:.0f}':>10}"
              f"{r['prefill_fraction']:>8.3f}{r['hit_rate']:>7.3f}{'-' if he is None else f'{he:.3f}':>10}"
              f"{r['ttft_p50_ms']:>10.0f}{r['ttft_p90_ms']:>8.0f}{r['output_tok_s']:>11.1f}"
              f"{f'{same}/{len(first)}':>10}")
    by = {r["server"]: r for r in rows}
    kv, p2 = by.get("conveyor kv_aware"), by.get("conveyor power_of_two")
    if kv and p2 and kv["prefill_computed_usage"]:
        print(f"\npower_of_two / kv_aware prefill tokens computed: "
              f"{p2['prefill_computed_usage'] / kv['prefill_computed_usage']:.2f}x (usage), "
              + (f"{p2['prefill_computed_engines'] / kv['prefill_computed_engines']:.2f}x (engine counters)"
                 if kv.get("prefill_computed_engines") else "engine counters unavailable")
              + f"; as a fraction of each one's prompt tokens: "
              f"{p2['prefill_fraction'] / kv['prefill_fraction']:.2f}x")


# ---- main ----------------------------------------------------------------------------------

def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="kv_aware,power_of_two,ray-llm",
                   help=f"comma list, run in order: our policies ({', '.join(POLICIES)}) and ray-llm")
    p.add_argument("--model", default=os.path.join(REPO, "bench", "out", "llama30m_v512"),
                   help="checkpoint with a tokenizer (bench/lib/models.py's 30m_v512 is built there if missing)")
    p.add_argument("--config", default=os.path.join(REPO, "configs", "tiny-cpu.yaml"))
    p.add_argument("--conveyor-set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--ray-llm-venv", default=launch.RAY_LLM_VENV)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=12288, help="KV cache per engine, in tokens")
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size of every server (vLLM's CPU attention takes multiples of 32)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--convs", type=int, default=Workload.convs)
    p.add_argument("--turns", type=int, default=Workload.turns)
    p.add_argument("--think-s", type=float, nargs=2, default=(Workload.think_s, Workload.think_max_s),
                   metavar=("MIN", "MAX"), help="think time after each answer, uniform in [MIN, MAX]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--answers", choices=("echo", "fixed"), default=Workload.answers,
                   help="assistant messages sent back: the server's own answer (echo) or the seed's fixed text")
    p.add_argument("--answer-vocab", choices=("words", "any"), default="words",
                   help="echo mode: sample answers from word tokens only (round-trip exactly) or any token")
    p.add_argument("--port", type=int, default=8400, help="first server port (+1 per server)")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--peer-start-timeout-s", type=float, default=200.0)
    p.add_argument("--out-dir", default=OUT)
    return p.parse_args(argv)


def make_servers(a: argparse.Namespace) -> list[Server]:
    """The --servers list: our policies and ray-llm, on consecutive ports."""
    out = []
    for i, name in enumerate(n.strip() for n in a.servers.split(",") if n.strip()):
        if name == "ray-llm":
            out.append(ray_llm(a, a.port + i))
        elif name in POLICIES:
            out.append(conveyor(a, name, a.port + i))
        else:
            raise SystemExit(f"unknown server {name!r}: one of {', '.join(POLICIES)}, ray-llm")
    return out


def main(argv: list[str] | None = None) -> int:
    """Each server in turn on the same workload; the table and the JSON."""
    a = _args(argv)
    a.model, a.config = os.path.abspath(a.model), os.path.abspath(a.config)
    os.makedirs(a.out_dir, exist_ok=True)
    if not os.path.isfile(os.path.join(a.model, "tokenizer.json")):
        from bench.lib.models import model_dir

        model_dir("30m_v512", a.model)
    w = Workload(convs=a.convs, turns=a.turns, think_s=a.think_s[0], think_max_s=a.think_s[1], seed=a.seed,
                 answers=a.answers, allowed_token_ids=word_token_ids(a.model)
                 if a.answers == "echo" and a.answer_vocab == "words" else ())
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    rows = []
    failed = []
    for s in make_servers(a):
        try:
            rows.append(measure(s, a, w))
        except Exception as e:  # noqa: BLE001 - one server that cannot run leaves the others' rows
            print(f"{s.name}: could not run: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            failed.append({"server": s.name, "error": f"{type(e).__name__}: {e}"[:4000]})
            continue
        r = rows[-1]
        print(f"{s.name}: {r['requests'] - r['failed']}/{r['requests']} ok, hit {r['hit_rate']:.3f}, "
              f"TTFT p90 {r['ttft_p90_ms']:.0f} ms, {r['output_tok_s']:.1f} out tok/s "
              f"{r['errors'] or ''}", flush=True)
    print_table(rows)
    meta = run_meta(date_utc=stamp, workload={**asdict(w), "allowed_token_ids": len(w.allowed_token_ids)},
                    engines=a.engines, kv_tokens=a.kv_tokens, block_size=a.block_size)
    path = os.path.join(a.out_dir, f"{stamp}-summary.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows, "could_not_run": failed}, f, indent=2)
    print(f"wrote {path}")
    return 0 if not failed and all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
