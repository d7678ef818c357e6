"""OpenAI-shaped chat messages with images, for the chat template.

A message's content is a string or a list of parts: {"type": "text", "text"},
{"type": "image_url", "image_url": {"url"}} (a data: URL, or http(s) from
multimodal.allowed_media_domains), or, offline, {"type": "image_pil",
"image_pil": PIL image}. The parts are concatenated in order into the
string the template renders, each image as the model's placeholder token
(LLaVA: "<image>"); the images are returned in the same order. The HTTP
server applies the same rule (conveyor/cluster/openai/server.py).
"""
from __future__ import annotations

from typing import Any

from conveyor.engine.config import EngineConfig
from conveyor.engine.multimodal.inputs import MultiModalInputError
from conveyor.engine.multimodal.media import MediaPolicy, load_image


def media_policy(config: EngineConfig) -> MediaPolicy:
    mm = config.multimodal
    return MediaPolicy(allowed_domains=tuple(mm.allowed_media_domains), max_image_pixels=mm.max_image_pixels)


def image_url_of(part: dict[str, Any]) -> str:
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise MultiModalInputError("an image_url part needs image_url.url")
    return url


def render_chat(messages: list[dict[str, Any]], placeholder: str | None,
                policy: MediaPolicy) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages with string contents, the images in order). placeholder None:
    the model takes text only, and an image part is refused before any fetch."""
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            content = _flatten(i, content, placeholder, policy, images)
        out.append({**m, "content": content if content is not None else ""})
    return out, images


def _flatten(i: int, parts: list[Any], placeholder: str | None, policy: MediaPolicy,
             images: list[Any]) -> str:
    text: list[str] = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text.append(str(part.get("text", "")))
            continue
        if kind not in ("image_url", "image_pil"):
            raise MultiModalInputError(f"messages[{i}]: content parts are text, image_url or image_pil, "
                                       f"got {kind!r}")
        if placeholder is None:
            raise MultiModalInputError("this model takes text only: image inputs need a vision-language model")
        images.append(part["image_pil"] if kind == "image_pil" else load_image(image_url_of(part), policy))
        text.append(placeholder)
    return "".join(text)
