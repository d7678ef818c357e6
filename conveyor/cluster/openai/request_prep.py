"""What the HTTP handlers need to keep one request from stalling the replica's
event loop: which jobs are built off the loop, and tokenization bounded by
characters before it starts (conveyor/cluster/openai/server.py)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from conveyor.cluster.openai import errors as E
from conveyor.engine.frontend.tokenizer import Tokenizer

# Texts below this many characters are tokenized inline (well under a millisecond).
INLINE_CHARS = 8192


def heavy(req: Any) -> bool:
    """Whether building `req`'s job may take long enough to stall the loop."""
    if getattr(req, "structured_outputs", None) or getattr(req, "response_format", None) \
            or getattr(req, "tools", None):
        return True
    prompt = getattr(req, "prompt", None)
    if isinstance(prompt, str):
        return len(prompt) >= INLINE_CHARS
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str)) >= INLINE_CHARS or len(prompt) > 64
    chars = 0
    for m in getattr(req, "messages", None) or ():
        c = m.content
        if not isinstance(c, str) and any(getattr(p, "type", "") == "image_url" for p in c or ()):
            return True  # decoding and preprocessing an image never runs on the event loop
        chars += len(c) if isinstance(c, str) else sum(len(getattr(p, "text", "")) for p in c or ())
    return chars >= INLINE_CHARS


T = TypeVar("T")


async def off_loop(pool: Executor, build: Callable[[Any, Any], T], req: Any, request: Any) -> T:
    """build(req, request) inline when cheap, else (a large text, a grammar to
    check) on `pool`: the event loop serves every other request meanwhile."""
    if not heavy(req):
        return build(req, request)
    return await asyncio.get_running_loop().run_in_executor(pool, build, req, request)


def tokenize_bounded(tok: Tokenizer, text: str, add_special_tokens: bool, param: str,
                     max_model_len: int) -> list[int]:
    """Never tokenize what cannot fit: each token covers at most
    tok.max_token_chars characters (x2: normalizers may drop some), so a
    longer text is refused at once. Large texts are encoded with the GIL
    released (their job runs on the prep pool: the loop goes on meanwhile)."""
    limit = max_model_len * tok.max_token_chars * 2
    if len(text) > limit:
        raise E.bad_request(
            f"the prompt has {len(text)} characters: more than the {limit} that this model's "
            f"context of {max_model_len} tokens could ever hold", param, "context_length_exceeded")
    if len(text) < INLINE_CHARS:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    return tok.encode_nogil(text, add_special_tokens=add_special_tokens)


def constraint_param(req: Any) -> str | None:
    """The request field the engine's grammar came from."""
    for name in ("structured_outputs", "response_format", "tool_choice"):
        if getattr(req, name, None) is not None:
            return name
    return None
