"""OpenAI wire format, requests: the body models (tools typed) and their
conversion to SamplingParams. Errors: errors.py; response bodies: bodies.py.

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

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from conveyor.cluster.openai.errors import bad_request
from conveyor.cluster.openai.structured_request import structured_outputs_of
from conveyor.engine.errors import ParamError
from conveyor.engine.frontend.json_limits import check_json_value
from conveyor.engine.sampling_params import SamplingParams

# ---- requests -----------------------------------------------------------------------

class StrictModel(BaseModel):
    """Every request model's rules: strict types (no "1" for 1), no NaN/inf,
    unknown fields ignored (clients send fields of newer API versions)."""
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")



class StreamOptions(StrictModel):
    include_usage: bool = False


class _BoundedFields(StrictModel):
    """Every field of the body, as sent, within conveyor/engine/frontend/json_limits.py's bounds
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


class _GenerationFields(_BoundedFields):
    """Fields shared by both endpoints (OpenAI + vLLM extras)."""

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


class CompletionRequest(_GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# ---- tools (OpenAI's function tools) ---------------------------------------------------

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128


class FunctionDef(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; compiled in tools/request.py
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _well_formed(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"must match {_NAME_RE.pattern}")
        return v


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: _FunctionName


class _CallFunction(_FunctionName):
    arguments: str


class AssistantToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: _CallFunction


def _unique_names(tools: list[ToolDef] | None) -> list[ToolDef] | None:
    seen: set[str] = set()
    for i, t in enumerate(tools or ()):
        if t.function.name in seen:
            raise ValueError(f"tools[{i}].function.name {t.function.name!r} is not unique")
        seen.add(t.function.name)
    return tools


# Validated once (FastAPI, or validate_model), and documented in the OpenAPI schema.
Tools = Annotated[list[ToolDef] | None, Field(max_length=MAX_TOOLS), AfterValidator(_unique_names)]


# ---- messages -------------------------------------------------------------------------

class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: Annotated[str, Field(min_length=1, max_length=64 << 20)]
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(StrictModel):
    """An image content part: a vision-language model's server loads it and
    puts the placeholder text in its place (images.py); for a text-only model
    `render_messages` refuses it with a 400 naming that, before any fetch."""
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImageURLPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # assistant turns; checked in tools/request.py (as AssistantToolCall)
    tool_call_id: str | None = None  # tool turns


class ChatRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: Tools = None
    tool_choice: Any = None  # "none" | "auto" | "required" | NamedToolChoice: checked in tools/request.py
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
    except ParamError as e:
        raise bad_request(str(e), renames.get(e.param, e.param)) from None
    except ValueError as e:  # not one field's: e.g. a structured_outputs mix
        raise bad_request(str(e)) from None


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
            if any(isinstance(p, ImageURLPart) for p in content):
                raise bad_request(f"model {req.model!r} takes text only: remove the image_url content parts "
                                  "(image inputs need a vision-language model)", "messages")
            content = "".join(p.text for p in content if isinstance(p, TextPart))
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out
