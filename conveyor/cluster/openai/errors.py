"""OpenAI-shaped errors: every client mistake becomes an `APIError` (an HTTP
status and the body `{"error": {"message", "type", "param", "code"}}` with
string type/code and `param` naming the offending field)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


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


def engine_unavailable(message: str = "the engine is not available") -> APIError:
    return APIError(503, message, type="service_unavailable_error", code="engine_unavailable",
                    headers={"Retry-After": "5"})


def at_capacity(limit: int) -> APIError:
    return APIError(429, f"The server is at capacity ({limit} requests in flight); retry later.",
                    type="rate_limit_error", code="server_at_capacity",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def too_many_sequences(cost: int, limit: int) -> APIError:
    return bad_request(f"this request asks for {cost} sequences (prompts x n); the server runs "
                       f"at most {limit} at once", "prompt", "too_many_sequences")


def internal_error() -> APIError:
    return APIError(500, "internal server error", type="internal_error", code="internal_error")
