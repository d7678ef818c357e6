"""StructuredOutputManager: compiles grammars off the step loop and builds the
per-step bitmask. Owned by EngineCore; the Scheduler calls it.

A structured request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR until its
future resolves. Its matcher only ever advances by tokens appended in
update_from_output, once each, so a preempted request (whose KV is recomputed,
not its tokens) resumes with its grammar state intact.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from conveyor.engine.structured_output.backend import Grammar, StructuredOutputBackend
from conveyor.engine.structured_output.params import StructuredOutputsParams
from conveyor.engine.structured_output.registry import make_backend


@dataclass
class StructuredOutputRequest:
    """The core's per-request grammar state."""
    params: StructuredOutputsParams
    future: Future[Grammar] | None = None
    grammar: Grammar | None = None
    error: str | None = None

    def ready(self) -> bool:
        """True once compiled (or failed); moves the result out of the future."""
        if self.grammar is not None or self.error is not None:
            return True
        fut = self.future
        if fut is None or not fut.done():
            return False
        exc = fut.exception()
        if exc is None:
            self.grammar = fut.result()
        else:
            self.error = f"structured output grammar failed to compile: {exc}"
        self.future = None
        return True


@dataclass
class StructuredOutputStats:
    """Cumulative; the frontends export them as metrics."""
    num_requests: int = 0
    compile_ms: list[float] = field(default_factory=list)  # drained by take_compile_ms
    compile_ms_recent: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    bitmask_ms_total: float = 0.0
    bitmask_steps: int = 0
    bitmask_rows: int = 0


class StructuredOutputManager:
    def __init__(self, backend_name: str, tokenizer_dir: str, vocab_size: int,
                 eos_token_id: Callable[[], int | None], compile_threads: int = 1,
                 allow_additional_properties: bool = False) -> None:
        """eos_token_id is called once, when the backend is first needed."""
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._args = (backend_name, tokenizer_dir, vocab_size)
        self._allow_additional = allow_additional_properties
        self._eos = eos_token_id
        self._lock = threading.Lock()
        self._backend: StructuredOutputBackend | None = None
        self._pool = ThreadPoolExecutor(max_workers=compile_threads,
                                        thread_name_prefix="conveyor-grammar")
        self.stats = StructuredOutputStats()
        self._bitmask_reported = (0.0, 0)  # stats totals at the last take_bitmask_since_last

    @property
    def backend(self) -> StructuredOutputBackend:
        with self._lock:  # compile threads and the step loop may race here
            if self._backend is None:  # built on first use: unstructured engines never pay
                self._backend = make_backend(*self._args, self._eos(), self._allow_additional)
        return self._backend

    def validate(self, params: StructuredOutputsParams) -> None:
        self.backend.validate(params)

    def submit(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        self.stats.num_requests += 1
        return StructuredOutputRequest(params, future=self._pool.submit(self._compile, params))

    def _compile(self, params: StructuredOutputsParams) -> Grammar:
        t0 = time.perf_counter()
        grammar = self.backend.compile(params)
        ms = (time.perf_counter() - t0) * 1e3
        self.stats.compile_ms.append(ms)
        self.stats.compile_ms_recent.append(ms)
        return grammar

    def take_bitmask_since_last(self) -> tuple[float, int]:
        """(bitmask ms, rows) since the last call: deltas of the cumulative stats."""
        st, (ms0, rows0) = self.stats, self._bitmask_reported
        self._bitmask_reported = (st.bitmask_ms_total, st.bitmask_rows)
        return st.bitmask_ms_total - ms0, st.bitmask_rows - rows0

    def take_compile_ms(self) -> list[float]:
        out, self.stats.compile_ms = self.stats.compile_ms, []
        return out

    def bitmask(self, grammars: list[Grammar], drafts: list[list[int]] | None = None) -> np.ndarray:
        """One row per grammar, in order: [len(grammars), ceil(vocab/32)] int32;
        with drafts (speculative decoding), len(drafts[i]) + 1 rows for grammars[i],
        row j its mask after drafts[i][:j] (the matchers are left unchanged)."""
        t0 = time.perf_counter()
        if drafts is None:
            mask = np.empty((len(grammars), self.num_words), dtype=np.int32)
        else:
            # Rows past a drafted EOS are never written by the backend; their
            # tokens are dropped (the request ends at the EOS), but they must
            # still give the sampler finite logits: allow everything.
            mask = np.full((sum(len(d) + 1 for d in drafts), self.num_words), -1, dtype=np.int32)
        self.backend.fill_bitmasks(grammars, mask, drafts)
        st = self.stats
        st.bitmask_ms_total += (time.perf_counter() - t0) * 1e3
        st.bitmask_steps += 1
        st.bitmask_rows += len(mask)
        return mask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
