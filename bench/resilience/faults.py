"""The faults of the resilience scenarios.

Periodic (a poisson load calls them every ``every_s``; each returns what it did):
- ``kill_worker``: SIGKILL a random Ray worker rank of the engine this
  process started (the engine detects it, rebuilds, recomputes);
- ``kill_or_drain``: alternating on alternating engines of a data-parallel
  AsyncLLM: kill an engine's worker (the engine is lost: its requests move at
  once and a new engine replaces it in the background), or drain it (its
  requests handed over, parallel.paced_drain) and then take requests again.

Per request (a closed load draws each request from it):
- ``hostile_requests``: well-formed requests, ones whose client walks away
  mid-stream, and invalid ones (each must get a 4xx in the OpenAI error shape).

Beside a phase (run in another process, never the measuring one):
- ``attackers``: closed-loop senders of grammar bombs (a regex a{100000}),
  2 MB-class prompts (1.9 MB, under the 2 MiB body cap) and 18k-character
  prompts (under the character bound, so tokenized before their 400).

  python -m bench.resilience.faults URL --seconds 20 --bombs 8 --big 2   # the attackers' child
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from typing import Any

from bench.lib.proc_tree import worker_pids
from bench.lib.sse import stream
from bench.resilience.load import Tally
from bench.resilience.targets import System

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- periodic -------------------------------------------------------------------------------

async def kill_worker(system: System, j: int, rng: random.Random) -> dict[str, Any] | None:
    """SIGKILL one of this process's Ray worker ranks, chosen at random."""
    pids = worker_pids()
    if not pids:
        return None
    pid = rng.choice(pids)
    os.kill(pid, signal.SIGKILL)
    return {"kind": "kill", "pid": pid}


async def _wait_state(dp: Any, k: int, state: str, bound_s: float = 60.0) -> None:
    end = time.monotonic() + bound_s
    while dp.states[k] != state:
        if time.monotonic() > end:
            raise TimeoutError(f"engine {k} never became {state}: {dp.states}")
        await asyncio.sleep(0.02)


async def kill_or_drain(system: System, j: int, rng: random.Random) -> dict[str, Any]:
    """Event j: kill (odd j) or drain (even j) engine ((j - 1) // 2) % 2; the
    seconds it took and the requests moved."""
    llm, kind, k = system.llm, ("kill", "drain")[(j - 1) % 2], ((j - 1) // 2) % 2
    dp, loop, t = llm.client, asyncio.get_running_loop(), time.monotonic()
    before = sum(dp.migrations.moved.values())
    if kind == "kill":
        os.kill(dp.clients[k].worker_pids()[0], signal.SIGKILL)
        await _wait_state(dp, k, "dead")
        lost_s = time.monotonic() - t
        await loop.run_in_executor(None, dp.replace_engine, k)
        out = {"lost_after_s": round(lost_s, 2), "replaced_after_s": round(time.monotonic() - t, 2)}
    else:
        await llm.drain(k, timeout_s=120)
        out = {"handover_s": round(time.monotonic() - t, 2)}
        llm.undrain(k)
    return {"kind": kind, "engine": k, "moved": sum(dp.migrations.moved.values()) - before, **out}


# ---- per request ----------------------------------------------------------------------------

# Each is refused with a 4xx in the OpenAI error shape: (path, raw body).
INVALID: list[tuple[str, bytes]] = [
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "x"'),
    ("/v1/completions", b'[1, 2]'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}'),
    ("/v1/completions", b'{"prompt": "x", "model": "no-such-model"}'),
    ("/v1/completions", b'{"prompt": [100000]}'),
    ("/v1/completions", b'{"prompt": "x", "n": 100000}'),
    ("/v1/completions", b'{"prompt": "", "max_tokens": 3}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
]
WORDS = ["the cat", "a dog", "runs", "sees the ball", "today.", "日本語の本", "in Zürich.", "😀"]


def valid_request(rng: random.Random, model: str | None) -> tuple[str, dict[str, Any], int]:
    """(path, body, number of choices) of one well-formed request: completions
    or chat, text or token ids, n 1 or 2, greedy or sampled, stop strings,
    streamed or not."""
    n = 2 if rng.random() < 0.1 else 1
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(8, 96), "n": n,
                            "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1 << 30),
                            "ignore_eos": rng.random() < 0.8, "stream": rng.random() < 0.9}
    if rng.random() < 0.1:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.2:
        body["messages"] = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=6))}]
        return "/v1/chat/completions", body, n
    if rng.random() < 0.5:
        body["prompt"] = [rng.randrange(10, 500) for _ in range(rng.randint(4, 96))]
    else:
        body["prompt"] = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
    return "/v1/completions", body, n


def is_openai_error(body: bytes) -> bool:
    """The body is {"error": {message, type, param, code}}, as OpenAI's."""
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and isinstance(err["code"], str))


def _refused(tally: Tally, status: int, content: bytes) -> None:
    if status == 429 and is_openai_error(content):
        tally.counts["backpressure_429"] += 1  # not accepted; allowed, reported
    else:
        tally.fail(f"valid request -> {status} {content[:200]!r}")


async def _send_valid(client: Any, rng: random.Random, tally: Tally, model: str | None, disconnect: bool) -> None:
    path, body, n = valid_request(rng, model)
    if disconnect:
        body["stream"] = True
    if not body["stream"]:
        r = await client.post(path, json=body)
        if r.status_code != 200:
            return _refused(tally, r.status_code, r.content)
        tally.counts["accepted"] += 1
        choices = r.json()["choices"]
        if len(choices) == n and all(c["finish_reason"] for c in choices):
            tally.counts["finished"] += 1
        else:
            tally.fail(f"non-stream without a finish_reason: {r.content[:200]!r}")
        return
    r = await stream(client, path, body, leave_after=rng.randint(1, 6) if disconnect else None)
    if r.status != 200:
        return _refused(tally, r.status, r.body) if r.status else tally.fail(r.error)
    tally.counts["accepted"] += 1
    if r.left:
        tally.counts["disconnected"] += 1
    elif r.error_code:
        tally.error_events[r.error_code] += 1
        tally.counts["ended_with_error_event"] += 1
        tally.fail(f"error event {r.error_code}")
    elif r.error:
        tally.fail(r.error)
    elif r.done and set(r.finish) == set(range(n)):
        tally.counts["finished"] += 1
    else:
        tally.fail(f"stream ended without finish/[DONE]: finished={sorted(r.finish)} done={r.done}")


async def hostile_requests(client: Any, rng: random.Random, tally: Tally, model: str | None,
                           fp: dict[str, Any]) -> None:
    """One request of the mix: invalid (invalid_fraction), dropped by the
    client mid-stream (disconnect_fraction), or well-formed."""
    x = rng.random()
    if x < fp["invalid_fraction"]:
        path, raw = rng.choice(INVALID)
        r = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
        if 400 <= r.status_code < 500 and is_openai_error(r.content):
            tally.counts["invalid_refused"] += 1
        else:
            tally.fail(f"invalid {raw[:60]!r} -> {r.status_code} {r.content[:120]!r}")
        return
    await _send_valid(client, rng, tally, model, x < fp["invalid_fraction"] + fp["disconnect_fraction"])


# ---- beside a phase -------------------------------------------------------------------------

async def attackers(system: System, fp: dict[str, Any], seconds: float) -> dict[str, int]:
    """The attackers, in a child process for ``seconds``; their status codes."""
    cmd = [sys.executable, "-m", "bench.resilience.faults", system.url, "--seconds", str(seconds),
           "--bombs", str(fp["bombs"]), "--big", str(fp["big"]), "--interval", str(fp["interval_s"])]
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=REPO, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=seconds + 300)
    return json.loads(out.decode().strip().splitlines()[-1])


async def _attacker(url: str, body: dict[str, Any], until: float, codes: Counter[str], kind: str,
                    interval: float) -> None:
    """Sends `body` again `interval` s after each answer (0: a closed-loop flood)."""
    import httpx

    data = json.dumps(body).encode()
    async with httpx.AsyncClient(timeout=120) as c:
        while time.monotonic() < until:
            r = await c.post(f"{url}/v1/completions", content=data, headers={"Content-Type": "application/json"})
            codes[f"{kind} {r.status_code}"] += 1
            await asyncio.sleep(interval)


async def _attack(a: argparse.Namespace) -> None:
    bomb = {"prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": "a{100000}"}}
    huge = {"prompt": "the cat sat " * 160_000, "max_tokens": 8}  # 1.92 MB
    mid = {"prompt": "the cat sat " * 1_500, "max_tokens": 8}  # 18k characters: under the bound
    codes: Counter[str] = Counter()
    until = time.monotonic() + a.seconds
    await asyncio.gather(*[_attacker(a.url, bomb, until, codes, "bomb", a.interval) for _ in range(a.bombs)],
                         *[_attacker(a.url, huge, until, codes, "2MB", a.interval) for _ in range(a.big)],
                         *[_attacker(a.url, mid, until, codes, "18k", a.interval) for _ in range(a.big)])
    print(json.dumps(dict(codes)), flush=True)


FAULTS = {"kill_worker": kill_worker, "kill_or_drain": kill_or_drain,
          "hostile_requests": hostile_requests, "attackers": attackers}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the attackers of the hostile scenario (prints their status codes)")
    ap.add_argument("url")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--bombs", type=int, default=8, help="concurrent grammar-bomb senders")
    ap.add_argument("--big", type=int, default=2, help="concurrent senders of each large prompt")
    ap.add_argument("--interval", type=float, default=1.0, help="pause after each answer (0: a flood)")
    asyncio.run(_attack(ap.parse_args()))
