"""OpenAI wire format: request models, conversion to SamplingParams, response
and stream-chunk builders, and the error body.

Invariants:
- Every client mistake becomes an `APIError` (status + OpenAI error body with
  string `type`/`code` and `param` naming the offending field); nothing here
  touches the engine, so validation finishes before anything is queued.
- Range checks live in SamplingParams (one place); this module only maps its
  ValueError's field name back to the request field the client sent.
- NaN/±inf: Python's json accepts the `NaN`/`Infinity` literals, so they reach
  the models; `allow_inf_nan=False` rejects them there with the field as param.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.json_limits import check_json_value
from engine.sampling_params import SamplingParams

# ---- errors -----------------------------------------------------------------------

class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str = "invalid_value", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.param, self.headers = param, headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx (the OpenAI error shape), for the schema."""
    error: ErrorDetail


def invalid_request(errors: Sequence[Any]) -> APIError:
    """A pydantic/FastAPI validation failure as the 400 a client sees: the first
    error's field is `param`. FastAPI prefixes locations with "body"; an error
    on the body as a whole (not JSON, not an object, missing) is invalid_json."""
    err = errors[0] if errors else {}
    loc = [str(p) for p in err.get("loc", ())]
    if loc[:1] == ["body"]:
        loc = loc[1:]
    kind = err.get("type")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "JSON decode error")
        return bad_request(f"request body is not valid JSON: {detail}", code="invalid_json")
    if not loc:
        if isinstance(err.get("input"), bytes):  # FastAPI: a non-JSON Content-Type
            return APIError(415, "Content-Type must be application/json",
                            code="unsupported_media_type")
        return bad_request("request body must be a JSON object", code="invalid_json")
    code = "missing_required_parameter" if kind == "missing" else "invalid_value"
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if not msg.startswith(loc[0]):  # our own checks name the path already
        msg = f"{'.'.join(loc)}: {msg}"
    return bad_request(msg, loc[0], code)


def validate_model(cls: type[BaseModel], obj: dict[str, Any]) -> Any:
    """For callers outside FastAPI (batch lines); routes get the model from FastAPI."""
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        raise invalid_request(e.errors()) from None


# ---- requests -----------------------------------------------------------------------

_MODEL_CONFIG = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(BaseModel):
    model_config = _MODEL_CONFIG
    include_usage: bool = False


class _BoundedFields(BaseModel):
    """Every field of the body, as sent, within engine/json_limits.py's bounds
    (valid Unicode, int64, nesting), before its own type check: a 400 naming
    the field instead of a failure deep inside (tokenizer, msgpack, json.dumps)."""

    @field_validator("*", mode="before")
    @classmethod
    def _bounded(cls, v: Any, info: Any) -> Any:
        check_json_value(v, info.field_name)
        return v


# OpenAI's spec marks these nullable (and clients send null for "not set"):
# an explicit null means the field is absent, so its default applies. The
# vLLM extras get the same rule.
_NULL_MEANS_ABSENT = frozenset({
    "n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "stream", "echo",
    "min_p", "repetition_penalty", "seed", "stop", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "stream_options", "user", "logit_bias", "top_k", "min_tokens",
    "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "priority", "suffix", "best_of", "add_generation_prompt", "allowed_token_ids",
    "prompt_logprobs", "parallel_tool_calls"})


class _SamplingRequest(_BoundedFields):
    """Fields shared by both endpoints (OpenAI + vLLM extras)."""
    model_config = _MODEL_CONFIG

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items() if v is not None or k not in _NULL_MEANS_ABSENT}
        return data

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Token id (a string, as JSON keys are) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    allowed_token_ids: list[int] | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = _MODEL_CONFIG
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _MODEL_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # assistant turns; checked in cluster/tools.py
    tool_call_id: str | None = None  # tool turns


class ChatRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None  # checked in cluster/tools.py, like tool_choice
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def check_unsupported(req: CompletionRequest | ChatRequest) -> None:
    """Reject features we do not implement instead of silently ignoring them."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n", "best_of", "unsupported_parameter")
        return


def chat_max_tokens(req: ChatRequest) -> tuple[int | None, str]:
    """(value, the field it came from); max_completion_tokens wins (OpenAI)."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def to_sampling_params(req: CompletionRequest | ChatRequest, max_tokens: int | None) -> SamplingParams:
    """Build (and so validate, once) SamplingParams; ValueError -> 400 naming
    the request field. max_tokens None: up to the context length."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        renames = {"logprobs": "top_logprobs", "max_tokens": chat_max_tokens(req)[1]}
    else:
        logprobs, renames = req.logprobs, {}
    from cluster.structured_request import structured_outputs_of

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    logit_bias = _logit_bias(req.logit_bias)
    kwargs: dict[str, Any] = dict(
        n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p,
        seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, skip_special_tokens=req.skip_special_tokens,
        structured_outputs=structured_outputs_of(req.response_format, req.structured_outputs),
        logit_bias=logit_bias, allowed_token_ids=req.allowed_token_ids)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        param = renames.get(field, field) if field in kwargs else None
        raise bad_request(str(e), param) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as string keys; the bounds are SamplingParams'."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.lstrip("-").isdigit()):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


def render_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template (text parts joined)."""
    out = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


# ---- responses ----------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens is the engines' own prefix-cache hit
    (RequestOutput.num_cached_tokens, summed over the prompts)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(reason: str | None) -> str | None:
    # "abort"/"error" never reach a successful response; keep OpenAI's two values.
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_choice(index: int, text: str, logprobs: dict | None, reason: str | None,
                      stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason(reason), "stop_reason": stop_reason}


def chat_choice(index: int, text: str, logprobs: dict | None, reason: str | None,
                stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason(reason),
            "stop_reason": stop_reason}


def chat_delta(index: int, delta: dict[str, Any], logprobs: dict | None = None,
               reason: str | None = None, stop_reason: int | str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish_reason(reason)}
    if reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def envelope(kind: str, rid: str, model: str, choices: list[dict[str, Any]],
             usage_: dict[str, int] | None = None, created: int | None = None) -> dict[str, Any]:
    """kind: text_completion | chat.completion | chat.completion.chunk."""
    out: dict[str, Any] = {"id": rid, "object": kind, "created": created or int(time.time()),
                           "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


_JSON = msgspec.json.Encoder()
# JSON escapes every control character, but not these three line breaks of
# str.splitlines(): generated text holding one would split the event for
# clients that break lines that way.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj.encode() if isinstance(obj, str) else _JSON.encode(obj)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# ---- logprobs -----------------------------------------------------------------------

def join_completion_logprobs(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two completions-shape logprobs one after the other (echoed prompt, then output)."""
    if a is None:
        return b
    return {key: a[key] + b[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _finite(x: float) -> float:
    # JSON has no -inf; vLLM clamps the same way.
    return x if math.isfinite(x) else -9999.0


class LogprobFormatter:
    """Turns the engine's per-token {token_id: logprob} dicts (top-k plus the
    sampled token) into OpenAI's completions/chat logprobs shapes."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = (self.tokenizer.decode([tid], skip_special_tokens=False)
                 if self.tokenizer is not None else f"token_id:{tid}")
            if len(self._cache) < 65536:
                self._cache[tid] = s
        return s

    @staticmethod
    def _top(d: dict[int, float], k: int) -> list[tuple[int, float]]:
        # The dict holds k entries, or k+1 when the sampled token is outside the
        # top-k; sorting and cutting at k recovers exactly the top-k.
        return sorted(d.items(), key=lambda kv: -kv[1])[:k]

    def completion(self, token_ids: list[int], lps: Sequence[dict[int, float] | None], k: int,
                   offset: int) -> tuple[dict[str, Any], int]:
        """offset: characters of this choice's tokens already sent (the
        text_offset base); returns the logprobs and the next offset. A None
        entry (the first prompt token) gets null logprob and top_logprobs."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, d in zip(token_ids, lps):
            s = self.token(tid)
            tokens.append(s)
            token_lps.append(None if d is None else _finite(d.get(tid, -math.inf)))
            tops.append({self.token(t): _finite(v) for t, v in self._top(d, k)}
                        if k and d is not None else None)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}, offset

    def prompt(self, token_ids: list[int], lps: list[dict[int, float] | None] | None,
               k: int) -> tuple[dict[str, Any], int]:
        """Echoed prompt tokens in the completions shape: the first token (and
        any without logprobs) has null token_logprobs / top_logprobs."""
        lps = list(lps or [])[:len(token_ids)]
        return self.completion(token_ids, lps + [None] * (len(token_ids) - len(lps)), k, 0)

    def _entry(self, tid: int, lp: float) -> dict[str, Any]:
        s = self.token(tid)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    def chat(self, token_ids: list[int], lps: list[dict[int, float]], k: int) -> dict[str, Any]:
        content = []
        for tid, d in zip(token_ids, lps):
            e = self._entry(tid, d.get(tid, -math.inf))
            e["top_logprobs"] = [self._entry(t, v) for t, v in self._top(d, k)]
            content.append(e)
        return {"content": content}
