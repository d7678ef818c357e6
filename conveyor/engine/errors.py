"""Errors shared by every layer of the engine (one class per kind)."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot continue: its core loop, its actor or a worker is
    gone, or a step failed. Every layer raises and catches this one class
    (executors re-export it), so a dead engine always reads as unavailable
    (HTTP 503), never as a bug of ours (500)."""


class DeadFlag:
    """The one record, per process, that an engine is dead: its core client
    owns it (CoreClient.dead) and the layers that must know share that object
    (AsyncLLM, the busy loop of an in-process core). Set once, the first
    cause wins, never cleared. (A worker group's failure is the executor's
    own state, which recovery may survive; a CoreLink's `dead` says that one
    actor link is closed, which a rebuilt actor survives.)"""

    __slots__ = ("_cause",)

    def __init__(self) -> None:
        self._cause: str | None = None

    @property
    def cause(self) -> str | None:
        return self._cause

    def set(self, cause: str) -> None:
        if self._cause is None:
            self._cause = cause

    def check(self) -> None:
        """Raise EngineDeadError with the cause once the engine is dead."""
        if self._cause is not None:
            raise EngineDeadError(self._cause)


class UnsendableRequestError(ValueError):
    """One request could not be encoded for the engine (a value the edge's
    checks should have refused). It fails alone, as the client's mistake
    (HTTP 400): the engine and every other request go on."""


class ParamError(ValueError):
    """An invalid request field: `param` names it (a SamplingParams field), so
    the HTTP layer sets the OpenAI error's `param` from it, never from the text."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[ParamError], tuple[str, str]]:
        # Pickled as (param, message): Ray and multiprocessing rebuild it whole.
        return ParamError, (self.param, str(self))


class KVLayoutMismatchError(ValueError):
    """An engine whose KV layout (model, dtype, block size, TP/PP) differs from
    the engines it would hand KV to or take KV from (P/D, moves, peer pulls)."""
