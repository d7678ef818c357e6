"""OpenAI response bodies and stream chunks as plain data: usage, choices,
deltas, the envelope, SSE framing and logprobs in both endpoints' shapes."""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import msgspec


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
