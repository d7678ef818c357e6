"""Images from OpenAI-shaped content parts, checked before they cost anything.

`load_image(url, policy)` takes a ``data:`` URL (always accepted) or an
http(s) URL (only from ``policy.allowed_domains``; empty: none) and returns
an RGB ``PIL.Image``. Every refusal is a `MediaError` subclass naming the
problem, which the server turns into a 400:
- `DisallowedMediaURL`: a scheme other than data/http/https, a host off the
  list, or a redirect that leaves it (each hop is checked; none is followed
  blindly);
- `MediaTooLarge`: more than ``policy.max_bytes`` of encoded data (counted while
  reading, so a lying Content-Length cannot pass) or more than
  ``policy.max_image_pixels`` pixels. The pixel count comes from the file's
  header before any pixel is decoded: a decompression bomb is refused at
  the cost of its header;
- `UnsupportedMediaFormat`: not PNG, JPEG, WebP or GIF (the first frame);
- `InvalidImage`: undecodable, truncated, or a base64 that is not;
- `MediaFetchError`: the server did not answer in time or not with 200.
`mm_hash(image)` is the content hash the scheduler's encoder cache and the
block hashes use: the same pixels give the same hash, whatever the URL.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class MediaError(ValueError):
    """An image input refused at the edge (HTTP 400)."""


class DisallowedMediaURL(MediaError):
    pass


class MediaTooLarge(MediaError):
    pass


class UnsupportedMediaFormat(MediaError):
    pass


class InvalidImage(MediaError):
    pass


class MediaFetchError(MediaError):
    pass


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()  # http(s) hosts; a leading "." allows subdomains
    max_bytes: int = 20 << 20  # encoded bytes of one image
    max_image_pixels: int = 16_777_216  # width * height (4096 x 4096)
    timeout_s: float = 10.0  # one fetch, connect and read
    max_redirects: int = 3


def load_image(url: str, policy: MediaPolicy) -> Any:
    """The image at ``url`` as RGB, within ``policy``."""
    if url.startswith("data:"):
        return decode_image(_data_url_bytes(url, policy), policy)
    return decode_image(_fetch(url, policy), policy)


def decode_image(data: bytes, policy: MediaPolicy) -> Any:
    """Encoded bytes -> RGB image: format and pixel count checked on the header first."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_bytes:
        raise MediaTooLarge(f"image is {len(data)} bytes; the limit is {policy.max_bytes}")
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as e:
        raise InvalidImage("image data could not be decoded (not an image, or truncated)") from e
    except Image.DecompressionBombError as e:
        raise MediaTooLarge(f"image header declares too many pixels: {e}") from e
    if img.format not in FORMATS:
        raise UnsupportedMediaFormat(f"image format {img.format} is not supported; use one of {', '.join(FORMATS)}")
    w, h = img.size
    if w <= 0 or h <= 0:
        raise InvalidImage(f"image has an empty size {w}x{h}")
    if w * h > policy.max_image_pixels:
        raise MediaTooLarge(f"image is {w}x{h} = {w * h} pixels; the limit is {policy.max_image_pixels} "
                            "(multimodal.max_image_pixels)")
    try:
        img.seek(0)
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise InvalidImage(f"image data could not be decoded: {e}") from e


def mm_hash(image: Any) -> str:
    """sha256 of the decoded RGB pixels and their size (hex)."""
    h = hashlib.sha256(f"RGB:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def _data_url_bytes(url: str, policy: MediaPolicy) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise InvalidImage("data URL has no ',' before its payload")
    media = head[len("data:"):]
    if not media.endswith(";base64"):
        raise InvalidImage("data URL must be base64 (data:image/<format>;base64,...)")
    mime = media[: -len(";base64")].lower()
    if mime and not mime.startswith("image/"):
        raise UnsupportedMediaFormat(f"data URL media type {mime!r} is not an image")
    if len(payload) > policy.max_bytes * 4 // 3 + 4:
        raise MediaTooLarge(f"image is over {policy.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidImage("data URL payload is not valid base64") from e


def domain_allowed(url: str, policy: MediaPolicy) -> bool:
    """http(s) to a host on the list (exact, or under a ".domain" entry)."""
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https") or not host:
        return False
    for d in policy.allowed_domains:
        d = d.lower()
        if host == d.lstrip(".") or (d.startswith(".") and host.endswith(d)):
            return True
    return False


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed URL, at most max_redirects times."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self.hops = 0

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        self.hops += 1
        if self.hops > self.policy.max_redirects:
            raise DisallowedMediaURL(f"image URL redirected more than {self.policy.max_redirects} times")
        if not domain_allowed(newurl, self.policy):
            raise DisallowedMediaURL("image URL redirects to a host not in multimodal.allowed_media_domains")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    if not domain_allowed(url, policy):
        raise DisallowedMediaURL("image URLs must be data: URLs, or http(s) from a host in "
                                 "multimodal.allowed_media_domains")
    opener = urllib.request.build_opener(_CheckedRedirects(policy))
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "conveyor"}),
                         timeout=policy.timeout_s) as resp:
            if resp.status != 200:
                raise MediaFetchError(f"image URL answered HTTP {resp.status}")
            data = resp.read(policy.max_bytes + 1)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        raise MediaFetchError(f"image URL answered HTTP {e.code}") from e
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise MediaFetchError(f"image URL could not be fetched: {e}") from e
    if len(data) > policy.max_bytes:
        raise MediaTooLarge(f"image is over {policy.max_bytes} bytes")
    return data
