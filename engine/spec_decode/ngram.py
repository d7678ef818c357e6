"""N-gram (prompt-lookup) drafts, computed in the engine core.

The core proposes because the drafts must be in the SchedulerOutput anyway
(every TP rank verifies the same drafts) and the core already holds every
request's tokens: no extra worker -> core message, no extra step of latency.
See ARCHITECTURE.md ("Speculative decoding") for the measured cost.
"""
from __future__ import annotations

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


def find_ngram_draft(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """The k tokens that followed the best earlier match of the sequence's suffix.

    The match length is the longest n in [n_min, n_max] for which the last n
    tokens occur earlier (ending at e < len). Among matches of that length the
    latest one with k tokens after it wins (the most recent context), else the
    earliest (the longest continuation). Empty if no suffix of n_min matches.
    Vectorised: one O(len) comparison finds the candidate ends (where the last
    token occurred), then each longer n is checked over the candidates only.
    """
    size = len(tokens)
    if k <= 0 or size <= n_min:
        return _EMPTY
    ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1]) + 1
    if ends.size == 0:
        return _EMPTY
    length = np.ones(ends.size, dtype=np.int32)
    alive = np.ones(ends.size, dtype=bool)
    for t in range(2, min(n_max, size - 1) + 1):
        idx = ends - t
        alive &= (idx >= 0) & (tokens[np.maximum(idx, 0)] == tokens[size - t])
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < n_min:
        return _EMPTY
    ends = ends[length == best]
    full = ends[ends + k <= size]
    e = int(full[-1]) if full.size else int(ends[0])
    return tokens[e:e + k]


class NgramProposer:
    """Keeps each request's tokens in a growing numpy buffer (appended to,
    never rebuilt from the Python list) and proposes from it.

    Miss gate: the hashes of every n_min-gram seen so far (the suffix's own
    excluded) sit in a set, so a suffix that never occurred before costs one
    set lookup instead of the numpy search; most steps of a sequence that does
    not repeat itself end there. A hash collision only lets a miss through to
    the exact search.
    """

    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self._buf: dict[str, np.ndarray] = {}
        self._len: dict[str, int] = {}
        self._grams: dict[str, set[int]] = {}
        self._suffix: dict[str, int | None] = {}
        self._gram_len: dict[str, int] = {}

    def propose(self, req_id: str, all_token_ids: list[int], k: int) -> list[int]:
        """Up to min(k, self.k) draft tokens for the request (maybe none)."""
        k = min(k, self.k)
        if k <= 0:
            return []
        self._sync_grams(req_id, all_token_ids)
        if self._suffix[req_id] not in self._grams[req_id]:
            return []
        tokens = self._sync(req_id, all_token_ids)
        return find_ngram_draft(tokens, k, self.n_min, self.n_max).tolist()

    def _sync_grams(self, req_id: str, all_token_ids: list[int]) -> None:
        grams = self._grams.setdefault(req_id, set())
        suffix = self._suffix.get(req_id)
        n, m = len(all_token_ids), self.n_min
        done = self._gram_len.get(req_id, 0)
        for end in range(max(done + 1, m), n + 1):
            if suffix is not None:
                grams.add(suffix)
            suffix = hash(tuple(all_token_ids[end - m:end]))
        self._suffix[req_id] = suffix
        self._gram_len[req_id] = n

    def _sync(self, req_id: str, all_token_ids: list[int]) -> np.ndarray:
        n = len(all_token_ids)
        buf = self._buf.get(req_id)
        have = self._len.get(req_id, 0)
        if buf is None or len(buf) < n:
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if buf is not None:
                grown[:have] = buf[:have]
            buf = self._buf[req_id] = grown
        if have < n:
            buf[have:n] = all_token_ids[have:n]
            self._len[req_id] = n
        return buf[:n]

    def drop(self, req_id: str) -> None:
        for d in (self._buf, self._len, self._grams, self._suffix, self._gram_len):
            d.pop(req_id, None)
