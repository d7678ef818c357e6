#!/usr/bin/env python3
"""Do hostile requests slow everyone else? (issue 31)

Serves a tiny checkpoint (uvicorn + the OpenAI app over one AsyncLLM, in a
child process, loopback only) and streams plain completions from C clients at
once, measuring each request's TPOT (time per output token after the first).
Phase "baseline": plain requests alone. Phase "attack": the same plain load
while attackers keep hostile requests in flight without pause:
  - grammar bombs: `structured_outputs.regex = a{100000}` (issue 31, item 4),
  - 2 MB-class prompts (1.9 MB of text, under the 2 MiB body cap; item 5),
  - 18k-character prompts: under the character bound (20k here), so they are tokenized
    (on the prep pool) before their context-length 400.
Reports the median and p90 TPOT of each phase, their ratio (the acceptance:
attack / baseline <= 1.2) and the attackers' status codes.

  python bench/hardening.py                       # builds bench/out/tiny-llama-hardening
  python bench/hardening.py --seconds 20 --clients 4 --bombs 8 --big 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def serve(model: str, port: int) -> None:
    """The child: one uvicorn server, one event loop, the uniproc engine."""
    import uvicorn

    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    cfg = build_config({"model": {"path": model, "max_model_len": 1024},
                        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512},
                        "serve": {"served_model_name": "tiny"}})
    llm = AsyncLLM(cfg)
    uvicorn.run(build_api(OpenAIServer(llm, cfg), api_key=None), host="127.0.0.1", port=port,
                log_level="error")


async def _plain(client, url: str, tokens: int) -> float | None:
    """One streamed plain request; its TPOT in seconds (None if it failed)."""
    body = {"prompt": "The cat sat on the mat and", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                times.append(time.perf_counter())
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


async def _clients(url: str, n: int, until: float, tokens: int) -> list[float]:
    import httpx

    tpots: list[float] = []

    async def one() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            while time.monotonic() < until:
                t = await _plain(c, url, tokens)
                if t is not None:
                    tpots.append(t)

    await asyncio.gather(*(one() for _ in range(n)))
    return tpots


async def _attacker(url: str, body: dict, until: float, codes: Counter, kind: str,
                    interval: float) -> None:
    """Sends `body` again `interval` s after each answer (0: a closed-loop flood)."""
    import httpx

    data = json.dumps(body).encode()
    async with httpx.AsyncClient(timeout=120) as c:
        while time.monotonic() < until:
            r = await c.post(f"{url}/v1/completions", content=data,
                             headers={"Content-Type": "application/json"})
            codes[f"{kind} {r.status_code}"] += 1
            await asyncio.sleep(interval)


def _attackers(url: str, args: argparse.Namespace, until: float, codes: Counter) -> list:
    bomb = {"prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": "a{100000}"}}
    huge = {"prompt": "the cat sat " * 160_000, "max_tokens": 8}  # 1.92 MB
    mid = {"prompt": "the cat sat " * 1_500, "max_tokens": 8}  # 18k characters: under the bound
    i = args.interval
    return ([_attacker(url, bomb, until, codes, "bomb", i) for _ in range(args.bombs)]
            + [_attacker(url, huge, until, codes, "2MB", i) for _ in range(args.big)]
            + [_attacker(url, mid, until, codes, "18k", i) for _ in range(args.big)])


async def _attack(url: str, args: argparse.Namespace) -> None:
    """The attackers' process (never the measuring one): prints the codes."""
    codes: Counter = Counter()
    await asyncio.gather(*_attackers(url, args, time.monotonic() + args.seconds, codes))
    print(json.dumps(dict(codes)), flush=True)


def _phase(url: str, args: argparse.Namespace, attack: bool) -> tuple[list[float], dict]:
    proc = None
    if attack:
        proc = subprocess.Popen([sys.executable, __file__, "--attack", url, "--seconds", str(args.seconds),
                                 "--bombs", str(args.bombs), "--big", str(args.big),
                                 "--interval", str(args.interval)],
                                cwd=REPO, stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)  # the attack is under way before the measurement starts
    tpots = asyncio.run(_clients(url, args.clients, time.monotonic() + args.seconds - 1.5, args.tokens))
    codes = json.loads(proc.communicate(timeout=300)[0].strip().splitlines()[-1]) if proc else {}
    return tpots, codes


def _summary(tpots: list[float]) -> dict[str, float]:
    q = statistics.quantiles(tpots, n=10)
    return {"requests": len(tpots), "tpot_median_ms": statistics.median(tpots) * 1e3,
            "tpot_p90_ms": q[-1] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(REPO, "bench", "out", "tiny-llama-hardening"))
    ap.add_argument("--seconds", type=float, default=20.0, help="per phase")
    ap.add_argument("--clients", type=int, default=4, help="concurrent plain streams")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per plain request")
    ap.add_argument("--bombs", type=int, default=8, help="concurrent grammar-bomb senders")
    ap.add_argument("--big", type=int, default=2, help="concurrent senders of each large prompt")
    ap.add_argument("--interval", type=float, default=1.0,
                    help="each attacker's pause after an answer (0: a closed-loop flood)")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # the server child: PORT
    ap.add_argument("--attack", default=None, help=argparse.SUPPRESS)  # the attackers' child: URL
    args = ap.parse_args()
    if args.serve:
        serve(args.model, int(args.serve))
        return 0
    if args.attack:
        asyncio.run(_attack(args.attack, args))
        return 0
    if not os.path.isdir(args.model):
        sys.path.insert(0, os.path.join(REPO, "tests", "cpu"))
        from llm_utils import make_checkpoint

        make_checkpoint("llama", args.model)
    from conveyor.parallel.ports import free_port

    port = free_port()
    child = subprocess.Popen([sys.executable, __file__, "--model", args.model, "--serve", str(port)],
                             cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, child)
        _phase(url, argparse.Namespace(**{**vars(args), "seconds": 4.0}), False)  # warm-up
        base, _ = _phase(url, args, attack=False)
        hit, codes = _phase(url, args, attack=True)
    finally:
        child.terminate()
        child.wait(30)
    b, a = _summary(base), _summary(hit)
    out = {"baseline": b, "attack": a, "ratio_median": a["tpot_median_ms"] / b["tpot_median_ms"],
           "ratio_p90": a["tpot_p90_ms"] / b["tpot_p90_ms"], "attackers": dict(codes),
           "args": {k: v for k, v in vars(args).items() if k not in ("serve", "attack")}}
    print(json.dumps(out, indent=2))
    return 0


def _wait_up(url: str, child: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not come up")


if __name__ == "__main__":
    sys.exit(main())
