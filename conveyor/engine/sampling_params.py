"""SamplingParams: the user-facing knobs of one request, validated at the edge.

Ranges follow vLLM's. Every check raises ParamError (a ValueError) naming the field in its `param`,
so the HTTP layer can turn it into an OpenAI error with `param` set.

Validated once: constructing a SamplingParams checks its fields (the edge);
the engine carries the result as SamplingFields, the same fields without the
checks, so a clone for an `n` child, a decode in the engine actor or a worker
(every step's SchedulerOutput) never re-runs them. The limits that depend on
the engine (n cap, context length, KV pool) are checked once per request by
the frontend (conveyor/engine/frontend/prepare.py).
"""
from __future__ import annotations

import math
from typing import Any

import msgspec

from conveyor.engine.errors import ParamError
from conveyor.engine.frontend.json_limits import utf8_problem
from conveyor.engine.structured_output.params import StructuredOutputsParams

# Upper bounds that are policy, not physics. n's cap is the engine's
# model.max_n (checked by the frontend); MAX_N bounds that knob, so a
# SamplingParams checks only what holds for every engine.
MAX_N = 128
MAX_LOGPROBS = 20
# Stop strings are scanned on every new token: bound their number and size.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# OpenAI's logit_bias bounds: at most 300 entries, each bias in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
# The engine also caps allowed_token_ids at its vocab size (frontend).
MAX_ALLOWED_TOKEN_IDS = 1 << 20
_INT64 = 2**63


class SamplingFields(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The fields of SamplingParams, trusted as they are: what the engine
    carries inside and what a decode produces (decoding runs no checks)."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len minus the prompt
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
    # vLLM's prompt_logprobs: for k, every prompt position after the first
    # gets {token_id: logprob} with the top-k plus the prompt's own token.
    prompt_logprobs: int | None = None
    # Added to the logits before sampling (OpenAI's logit_bias; ids < vocab).
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: every other token is masked out.
    allowed_token_ids: list[int] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    # Equality is msgspec's: same class and same values. What the engine
    # carries is always a SamplingFields (trusted_copy), as is every decode.

    def clone(self, **changes: Any) -> SamplingFields:
        """A copy of the same type with `changes`: a SamplingParams checks them."""
        return msgspec.structs.replace(self, **changes)

    def trusted_copy(self, **changes: Any) -> SamplingFields:
        """A SamplingFields copy with `changes` the engine itself made (n
        children, resolved EOS ids): never re-validated."""
        values = msgspec.structs.asdict(self)
        values.update(changes)
        return SamplingFields(**values)


def resolved_max_tokens(sp: SamplingFields, prompt_len: int, max_model_len: int) -> int:
    """The one resolution of max_tokens: None means up to max_model_len minus
    the prompt (vLLM)."""
    return sp.max_tokens if sp.max_tokens is not None else max_model_len - prompt_len


def child_seed(seed: int | None, k: int) -> int | None:
    """The seed of the k-th of n children: seed + k, kept in int64."""
    if seed is None:
        return None
    return (seed + k + _INT64) % (2 * _INT64) - _INT64


class SamplingParams(SamplingFields):
    """What users construct; invalid values raise ValueError naming the field."""

    def __post_init__(self) -> None:
        # Runs on construction only where the type is SamplingParams: the
        # engine's own messages carry SamplingFields and skip it.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        _int("n", self.n, lo=1, hi=MAX_N)
        _float("temperature", self.temperature, lo=0.0)
        _float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _int("top_k", self.top_k, lo=0, hi=_INT64 - 1)  # >= vocab: off
        _float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _int("seed", self.seed, lo=-_INT64, hi=_INT64 - 1)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, lo=1, hi=_INT64 - 1)
        _int("min_tokens", self.min_tokens, lo=0, hi=_INT64 - 1)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens", f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"> max_tokens={self.max_tokens}")
        _str_list("stop", self.stop, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)
        _int_list("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _bool(name, getattr(self, name))
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.logit_bias is not None:
            _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            _int_list("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
            if not self.allowed_token_ids:
                raise ParamError("allowed_token_ids", "allowed_token_ids must not be empty")
        _float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=1e4, lo_open=True)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ParamError("structured_outputs",
                             f"structured_outputs must be a StructuredOutputsParams, got {so!r}")


def _int(name: str, v: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ParamError(name, f"{name} must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise ParamError(name, f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ParamError(name, f"{name} must be <= {hi}, got {v}")


def _float(name: str, v: object, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ParamError(name, f"{name} must be a number, got {v!r}")
    if not math.isfinite(v):
        raise ParamError(name, f"{name} must be finite, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ParamError(name, f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise ParamError(name, f"{name} must be <= {hi}, got {v}")


def _logit_bias(v: object) -> None:
    """Token ids >= 0 (the vocab bound is the engine's: frontend), biases finite in [-100, 100]."""
    if not isinstance(v, dict):
        raise ParamError("logit_bias", f"logit_bias must be a map of token id to bias, got {v!r}")
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise ParamError("logit_bias",
                         f"logit_bias must hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(v)}")
    for tid, bias in v.items():
        _int("logit_bias", tid, lo=0)
        _float("logit_bias", bias, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)


def _bool(name: str, v: object) -> None:
    if not isinstance(v, bool):
        raise ParamError(name, f"{name} must be a boolean, got {v!r}")


def _str_list(name: str, v: object, max_items: int, max_chars: int) -> None:
    if not isinstance(v, list):
        raise ParamError(name, f"{name} must be a string or a list of strings, got {v!r}")
    if len(v) > max_items:
        raise ParamError(name, f"{name} must hold at most {max_items} strings, got {len(v)}")
    for s in v:
        if not isinstance(s, str):
            raise ParamError(name, f"{name} entries must be strings, got {s!r}")
        if s == "":
            raise ParamError(name, f"{name} must not contain empty strings")
        if len(s) > max_chars:
            raise ParamError(name, f"{name} strings must be at most {max_chars} characters, got {len(s)}")
        problem = utf8_problem(s)
        if problem is not None:  # it could never be sent to the engine (msgpack is UTF-8)
            raise ParamError(name, f"{name} entry {problem}")


def _int_list(name: str, v: object, max_items: int) -> None:
    if not isinstance(v, list):
        raise ParamError(name, f"{name} must be a list of integers, got {v!r}")
    if len(v) > max_items:
        raise ParamError(name, f"{name} must hold at most {max_items} token ids, got {len(v)}")
    for t in v:
        _int(name, t, lo=0, hi=_INT64 - 1)  # the engine's own check: < vocab size
