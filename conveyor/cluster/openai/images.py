"""Chat image_url parts at the edge: counted and checked before any fetch,
loaded under the engine's media policy (conveyor/engine/multimodal/media.py:
data: URLs always, http(s) only from multimodal.allowed_media_domains), and
replaced by the model's placeholder text, so the chat template renders the
same string llm.chat would (conveyor/engine/multimodal/chat.py: parts
concatenated in order). Runs on the server's prep pool, never on the event
loop. Every refusal is a 400 naming the problem."""
from __future__ import annotations

from typing import Any

from conveyor.cluster.openai import protocol as P
from conveyor.cluster.openai.errors import bad_request
from conveyor.engine.multimodal.media import MediaError, MediaPolicy, load_image


def _image_parts(m: P.ChatMessage) -> list[P.ImageURLPart]:
    return [p for p in m.content if isinstance(p, P.ImageURLPart)] if isinstance(m.content, list) else []


def split_images(req: P.ChatRequest, placeholder: str | None, policy: MediaPolicy,
                 limit: int) -> tuple[P.ChatRequest, list[Any]]:
    """(the request with each image part as `placeholder` text, the images in
    order). placeholder None: the model takes text only."""
    count = sum(len(_image_parts(m)) for m in req.messages)
    if not count:
        return req, []
    if placeholder is None:
        raise bad_request(f"model {req.model!r} takes text only: remove the image_url content parts "
                          "(image inputs need a vision-language model)", "messages")
    if count > limit:
        raise bad_request(f"{count} images in one request; the limit is {limit} "
                          "(multimodal.limit_per_prompt)", "messages")
    images: list[Any] = []
    messages = []
    for m in req.messages:
        if _image_parts(m):
            parts: list[Any] = []
            for p in m.content or []:
                if isinstance(p, P.ImageURLPart):
                    try:
                        images.append(load_image(p.image_url.url, policy))
                    except MediaError as e:
                        raise bad_request(str(e), "messages") from None
                    p = P.TextPart(type="text", text=placeholder)
                parts.append(p)
            m = m.model_copy(update={"content": parts})
        messages.append(m)
    return req.model_copy(update={"messages": messages}), images
