"""N-gram (prompt-lookup) drafts, computed in the engine core.

The core proposes because the drafts must be in the SchedulerOutput anyway
(every TP rank verifies the same drafts) and the core already holds every
request's tokens: no extra worker -> core message, no extra step of latency.
See docs/spec_decode.md for the measured cost.
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


def _gram_key(tokens: list[int], end: int, n: int) -> int:
    """tokens[end - n:end] packed into one int, exactly (ids are < 2**32).
    An int key, unlike a tuple, is not tracked by the garbage collector: an
    index that grows by a tracked object per request per step makes the
    collector run during every step (measured: 17 collections per generate()
    at batch 32 with tuple keys and list values, none without)."""
    if n == 2:
        return (tokens[end - 2] << 32) | tokens[end - 1]
    key = 0
    for t in tokens[end - n:end]:
        key = (key << 32) | t
    return key


class _RequestIndex:
    """One request's n_min-gram index: packed gram -> its end position, or
    the list of them (ascending) once it occurred twice; grams ending before
    `indexed` are in it."""

    __slots__ = ("grams", "indexed")

    def __init__(self) -> None:
        self.grams: dict[int, int | list[int]] = {}
        self.indexed = 0


class NgramProposer:
    """Proposes what find_ngram_draft would, from an incremental index.

    Per request, a dict maps every n_min-gram that ended at some e < len (the
    suffix itself excluded) to its end positions, ascending. Tokens are only
    ever appended, so each step indexes one or a few new grams and looks the
    suffix's n_min-gram up: a miss (text that does not repeat) costs two
    packed keys and two dict operations, about 1 us, and allocates nothing
    that outlives the step (this runs for every running request every step,
    so a miss must cost next to nothing); on a hit, each candidate's match is
    extended backwards up to n_max, latest candidate first, stopping at the
    first one that matches n_max tokens and has k tokens after it (where
    cyclic text always ends). The vectorised search cost O(len) numpy work
    per step instead (30-50 us).
    """

    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self._index: dict[str, _RequestIndex] = {}

    def propose(self, req_id: str, all_token_ids: list[int], k: int) -> list[int]:
        """Up to min(k, self.k) draft tokens for the request (maybe none)."""
        k = min(k, self.k)
        if k <= 0:
            return []
        tokens, size, lo = all_token_ids, len(all_token_ids), self.n_min
        index = self._sync(req_id, tokens)
        found = index.get(_gram_key(tokens, size, lo)) if size > lo else None
        if found is None:
            return []
        ends = (found,) if isinstance(found, int) else found
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

    def _sync(self, req_id: str, tokens: list[int]) -> dict[int, int | list[int]]:
        st = self._index.get(req_id)
        if st is None:
            st = self._index[req_id] = _RequestIndex()
        index, n = st.grams, self.n_min
        stop = len(tokens)  # the gram ending at len(tokens) is the suffix: not yet
        e = st.indexed if st.indexed > n else n  # grams tokens[e - n:e], e in [first, stop)
        if e < stop:
            key = _gram_key(tokens, e, n)
            mask = (1 << (32 * n)) - 1
            while True:
                prev = index.get(key)
                if prev is None:
                    index[key] = e
                elif isinstance(prev, int):
                    index[key] = [prev, e]
                else:
                    prev.append(e)
                e += 1
                if e >= stop:
                    break
                key = ((key << 32) | tokens[e - 1]) & mask  # roll the gram by one token
            st.indexed = stop
        return index

    def drop(self, req_id: str) -> None:
        self._index.pop(req_id, None)
