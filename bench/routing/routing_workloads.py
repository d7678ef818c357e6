"""Workloads for bench/routing/routing.py, each a list of SimRequests (token ids
hashed with the engine's own block hash chain, conveyor/engine/dp/router/policy.py).

- shared_prefix: vLLM's prefix_repetition shape: groups sharing a 512-token
  prefix, each request a unique 128-token suffix, random order.
- multi_turn: conversations that share a system prompt; turn k's prompt is
  turn k-1's prompt + its answer + a new user message, released when turn k-1
  finishes plus a think time.
- trace: a Mooncake-format JSONL trace (timestamp ms, input_length,
  output_length, hash_ids of 512-token blocks); the tokens of block id h are
  synthesised from h, so equal ids give equal tokens and equal hashes.
  `write_synthetic_trace` makes one deterministically.
"""
from __future__ import annotations

import json
import random

from bench.routing.routing_sim import FollowUps, SimRequest
from conveyor.engine.dp.router.policy import block_hashes_of
from conveyor.engine.kv_cache.hashing import hash_block

TRACE_BLOCK = 512


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 32000) for _ in range(n)]


def shared_prefix(bs: int, groups: int = 32, per_group: int = 48, rate: float = 2.0,
                  seed: int = 0) -> list[SimRequest]:
    """Groups of requests sharing a 512-token prefix, each with a unique 128-token suffix."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, 512) for _ in range(groups)]
    jobs = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(jobs)
    out = []
    for i, g in enumerate(jobs):
        toks = prefixes[g] + _tokens(rng, 128)
        out.append(SimRequest(f"sp{i}", block_hashes_of(toks, bs), len(toks), 64, int(i / rate)))
    return out


class MultiTurn(FollowUps):
    """Conversations over one system prompt; each turn extends the last by its answer and a message."""
    def __init__(self, bs: int, convs: int = 96, turns: int = 6, seed: int = 0) -> None:
        self.bs, self.turns = bs, turns
        self.rng = random.Random(seed)
        self.system = _tokens(self.rng, 256)
        self.history: dict[str, list[int]] = {}
        self.turn: dict[str, int] = {}
        self.first = [self._make(f"c{c}", c * 3) for c in range(convs)]

    def _make(self, conv: str, arrival: int) -> SimRequest:
        hist = self.history.setdefault(conv, list(self.system))
        hist += _tokens(self.rng, 64)  # the user's message
        k = self.turn[conv] = self.turn.get(conv, 0) + 1
        return SimRequest(f"{conv}-t{k}", block_hashes_of(hist, self.bs), len(hist), 64, arrival,
                          session=conv)

    def next_after(self, done: SimRequest, now: int) -> list[SimRequest]:
        """The conversation's next turn, after a think time (none after the last)."""
        conv = done.rid.split("-")[0]
        if self.turn[conv] >= self.turns:
            return []
        self.history[conv] += _tokens(self.rng, done.output_len)  # the answer
        return [self._make(conv, now + self.rng.randint(5, 40))]


def write_synthetic_trace(path: str, n: int = 600, seed: int = 0) -> None:
    """A Mooncake-format trace: sessions that grow turn by turn, requests that
    share one of a few long documents, and one-off requests; Poisson arrivals."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + k))
        next_id += k
        return ids

    docs = [fresh(rng.randint(3, 8)) for _ in range(12)]
    sessions: list[list[int]] = []
    t = 0.0
    with open(path, "w") as f:
        for _ in range(n):
            t += rng.expovariate(1 / 120.0)  # ms between arrivals
            kind = rng.random()
            if kind < 0.4 and sessions:
                s = rng.randrange(len(sessions))
                sessions[s] = sessions[s] + fresh(rng.randint(1, 2))
                ids = sessions[s]
                if len(ids) > 14:
                    sessions.pop(s)
            elif kind < 0.7:
                ids = rng.choice(docs) + fresh(rng.randint(1, 2))
                if rng.random() < 0.3:
                    sessions.append(ids)
            else:
                ids = fresh(rng.randint(1, 4))
                sessions.append(ids)
            line = {"timestamp": int(t), "input_length": len(ids) * TRACE_BLOCK - rng.randrange(0, 256),
                    "output_length": rng.randint(16, 256), "hash_ids": ids}
            f.write(json.dumps(line) + "\n")


def trace(path: str, bs: int, tick_ms: float = 10.0, limit: int | None = None) -> list[SimRequest]:
    """The SimRequests of a Mooncake-format trace (block ids made into tokens, then hashed)."""
    memo: dict[tuple[bytes | None, int], list[bytes]] = {}
    out = []
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    for i, row in enumerate(lines[:limit]):
        hashes: list[bytes] = []
        parent: bytes | None = None
        for h in row["hash_ids"]:
            key = (parent, h)
            blk = memo.get(key)
            if blk is None:
                blk = memo[key] = _chain(parent, _block_tokens(h), bs)
            hashes += blk
            parent = blk[-1]
        n = min(row["input_length"], len(row["hash_ids"]) * TRACE_BLOCK)
        out.append(SimRequest(f"tr{i}", hashes[:n // bs], n, int(row["output_length"]),
                              int(row["timestamp"] / tick_ms)))
    return out


def _block_tokens(h: int) -> list[int]:
    return _tokens(random.Random(h * 1_000_003 + 7), TRACE_BLOCK)


def _chain(parent: bytes | None, tokens: list[int], bs: int) -> list[bytes]:
    out = []
    for s in range(0, len(tokens), bs):
        parent = hash_block(parent, tokens[s:s + bs], None)
        out.append(parent)
    return out
