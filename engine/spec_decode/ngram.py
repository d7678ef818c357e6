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

    Per request and per n in [n_min, n_max], a dict maps every n-gram that
    ended at some e < len (the suffix itself excluded) to its end positions,
    ascending. Tokens are only ever appended, so each step indexes the few new
    grams and then looks the suffix up, longest n first: a handful of dict
    operations per request, whatever the sequence's length (the vectorised
    search costs O(len) numpy work per step, 30-50 us at batch 32).
    """

    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self._index: dict[str, list[dict[tuple[int, ...], list[int]]]] = {}
        self._indexed: dict[str, int] = {}  # grams ending before this are indexed

    def propose(self, req_id: str, all_token_ids: list[int], k: int) -> list[int]:
        """Up to min(k, self.k) draft tokens for the request (maybe none)."""
        k = min(k, self.k)
        if k <= 0:
            return []
        index = self._sync(req_id, all_token_ids)
        size = len(all_token_ids)
        lo = self.n_min
        # Every longer match contains the n_min one: a miss costs one lookup.
        if size <= lo or tuple(all_token_ids[size - lo:]) not in index[0]:
            return []
        for n in range(min(self.n_max, size - 1), lo - 1, -1):
            ends = index[n - self.n_min].get(tuple(all_token_ids[size - n:]))
            if ends is None:
                continue
            # The latest match with k tokens after it, else the earliest.
            e = ends[0]
            for cand in reversed(ends):
                if cand + k <= size:
                    e = cand
                    break
            return all_token_ids[e:e + k]
        return []

    def _sync(self, req_id: str, tokens: list[int]) -> list[dict[tuple[int, ...], list[int]]]:
        index = self._index.get(req_id)
        if index is None:
            index = self._index[req_id] = [{} for _ in range(self.n_min, self.n_max + 1)]
        start = self._indexed.get(req_id, 0)
        stop = len(tokens)  # the gram ending at len(tokens) is the suffix: not yet
        for n in range(self.n_min, self.n_max + 1):
            first = max(start, n)  # grams tokens[e - n:e] for e in [first, stop)
            if first >= stop:
                continue
            d = index[n - self.n_min]
            seg = tokens[first - n:stop - 1]
            # zip builds the n-tuples in C (a whole prompt on the first call).
            for e, gram in zip(range(first, stop), zip(*(seg[i:] for i in range(n)))):
                d.setdefault(gram, []).append(e)
        self._indexed[req_id] = max(start, stop)
        return index

    def drop(self, req_id: str) -> None:
        self._index.pop(req_id, None)
        self._indexed.pop(req_id, None)
