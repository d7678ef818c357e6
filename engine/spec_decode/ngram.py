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
    """Proposes what find_ngram_draft would, from an incremental index.

    Per request, a dict maps every n_min-gram that ended at some e < len (the
    suffix itself excluded) to its end positions, ascending. Tokens are only
    ever appended, so each step indexes one or a few new grams and looks the
    suffix's n_min-gram up: a miss (text that does not repeat) costs one dict
    lookup; on a hit, each candidate's match is extended backwards up to n_max,
    latest candidate first, stopping at the first one that matches n_max
    tokens and has k tokens after it (where cyclic text always ends). The
    vectorised search cost O(len) numpy work per step instead (30-50 us).
    """

    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self._index: dict[str, dict[tuple[int, ...], list[int]]] = {}
        self._indexed: dict[str, int] = {}  # grams ending before this are indexed

    def propose(self, req_id: str, all_token_ids: list[int], k: int) -> list[int]:
        """Up to min(k, self.k) draft tokens for the request (maybe none)."""
        k = min(k, self.k)
        if k <= 0:
            return []
        index = self._sync(req_id, all_token_ids)
        tokens, size, lo = all_token_ids, len(all_token_ids), self.n_min
        ends = index.get(tuple(tokens[size - lo:])) if size > lo else None
        if ends is None:
            return []
        cap = min(self.n_max, size - 1)
        best_len, latest_full, earliest = -1, -1, -1
        for e in reversed(ends):
            n = lo
            while n < cap and e > n and tokens[e - n - 1] == tokens[size - n - 1]:
                n += 1
            if n > best_len:
                best_len, earliest = n, e
                latest_full = e if e + k <= size else -1
            elif n == best_len:
                earliest = e
                if latest_full < 0 and e + k <= size:
                    latest_full = e
            if best_len == cap and latest_full >= 0:
                break  # no longer match exists, and this is the latest with room
        # The latest longest match with k tokens after it, else the earliest.
        e = latest_full if latest_full >= 0 else earliest
        return tokens[e:e + k]

    def _sync(self, req_id: str, tokens: list[int]) -> dict[tuple[int, ...], list[int]]:
        index = self._index.get(req_id)
        if index is None:
            index = self._index[req_id] = {}
        n = self.n_min
        start = self._indexed.get(req_id, 0)
        stop = len(tokens)  # the gram ending at len(tokens) is the suffix: not yet
        first = max(start, n)  # grams tokens[e - n:e] for e in [first, stop)
        if first < stop:
            seg = tokens[first - n:stop - 1]
            # zip builds the n-tuples in C (a whole prompt on the first call).
            for e, gram in zip(range(first, stop), zip(*(seg[i:] for i in range(n)))):
                ends = index.get(gram)
                if ends is None:
                    index[gram] = [e]
                else:
                    ends.append(e)
        self._indexed[req_id] = max(start, stop)
        return index

    def drop(self, req_id: str) -> None:
        self._index.pop(req_id, None)
        self._indexed.pop(req_id, None)
