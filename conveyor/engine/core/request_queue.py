"""Waiting queues: FCFS (arrival order) and priority (lower value first, then
arrival time). Preempted requests go back to the front of FCFS; under priority
the heap order already puts them where they belong."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from conveyor.engine.core.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, r: Request) -> None:
        self._q.append(r)

    def prepend(self, r: Request) -> None:
        self._q.appendleft(r)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, r: Request) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, r: Request) -> None:
        heapq.heappush(self._heap, (r.priority, r.arrival_time, next(self._seq), r))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, r: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not r]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
