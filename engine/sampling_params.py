"""SamplingParams: the user-facing knobs of one request, validated at the edge.

Ranges follow vLLM's. Every check raises ValueError naming the field, so the
HTTP layer can turn it into an OpenAI error with `param` set.
"""
from __future__ import annotations

import math
from typing import Any

import msgspec

from engine.structured_output.params import StructuredOutputsParams

# Upper bounds that are policy, not physics; the engine config may lower them.
DEFAULT_MAX_N = 128
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Runs on construction and on msgspec decode: a worker never sees an
        # invalid SamplingParams.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self, max_n: int = DEFAULT_MAX_N) -> None:
        _int("n", self.n, lo=1, hi=max_n)
        _float("temperature", self.temperature, lo=0.0)
        _float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _int("top_k", self.top_k, lo=0)
        _float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, lo=1)
        _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"> max_tokens={self.max_tokens}")
        _str_list("stop", self.stop)
        _int_list("stop_token_ids", self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _bool(name, getattr(self, name))
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        _float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=1e4, lo_open=True)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {so!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _int(name: str, v: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")


def _float(name: str, v: object, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")


def _bool(name: str, v: object) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a boolean, got {v!r}")


def _str_list(name: str, v: object) -> None:
    if not isinstance(v, list):
        raise ValueError(f"{name} must be a string or a list of strings, got {v!r}")
    for s in v:
        if not isinstance(s, str):
            raise ValueError(f"{name} entries must be strings, got {s!r}")
        if s == "":
            raise ValueError(f"{name} must not contain empty strings")


def _int_list(name: str, v: object) -> None:
    if not isinstance(v, list):
        raise ValueError(f"{name} must be a list of integers, got {v!r}")
    for t in v:
        _int(name, t, lo=0)
