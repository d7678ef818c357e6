"""Images at the edge (conveyor/engine/multimodal/media.py): what decodes, what
is refused and why, with no pixel decoded for a bomb, and URLs fetched only
from the allowed hosts (a loopback server here)."""
from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator

import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from conveyor.engine.multimodal.media import (  # noqa: E402
    DisallowedMediaURL,
    InvalidImage,
    MediaFetchError,
    MediaPolicy,
    MediaTooLarge,
    UnsupportedMediaFormat,
    decode_image,
    load_image,
    mm_hash,
)

POLICY = MediaPolicy()


def _encoded(fmt: str, size: tuple[int, int] = (5, 3), color: tuple[int, int, int] = (10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_supported_format_decodes_to_rgb(fmt: str) -> None:
    img = load_image(_data_url(_encoded(fmt), f"image/{fmt.lower()}"), POLICY)
    assert img.mode == "RGB" and img.size == (5, 3)


def test_the_hash_follows_the_pixels_not_the_encoding() -> None:
    png = load_image(_data_url(_encoded("PNG")), POLICY)
    gif = load_image(_data_url(_encoded("GIF"), "image/gif"), POLICY)  # lossless for a flat color
    other = load_image(_data_url(_encoded("PNG", color=(10, 200, 31))), POLICY)
    bigger = load_image(_data_url(_encoded("PNG", size=(3, 5))), POLICY)
    assert mm_hash(png) == mm_hash(gif)
    assert len({mm_hash(png), mm_hash(other), mm_hash(bigger)}) == 3


def _png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header (CRC fixed) says width x height."""
    data = bytearray(_encoded("PNG", size=(1, 1)))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr:ihdr + 17]))
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


@pytest.mark.parametrize("side", [5000, 200_000])
def test_a_decompression_bomb_is_refused_by_its_header(side: int) -> None:
    t = time.perf_counter()
    with pytest.raises(MediaTooLarge, match="pixels"):
        decode_image(_png_claiming(side, side), POLICY)
    assert time.perf_counter() - t < 0.5  # nothing was decoded


@pytest.mark.parametrize("url, error, words", [
    ("data:image/png;base64,@@@@", InvalidImage, "base64"),
    (_data_url(b"not an image at all"), InvalidImage, "decoded"),
    (_data_url(_encoded("PNG")[:40]), InvalidImage, "decoded"),
    ("data:image/png,rawbytes", InvalidImage, "base64"),
    (_data_url(_encoded("BMP"), "image/bmp"), UnsupportedMediaFormat, "BMP"),
    (_data_url(_encoded("PNG"), "text/plain"), UnsupportedMediaFormat, "not an image"),
    ("file:///etc/passwd", DisallowedMediaURL, "allowed_media_domains"),
    ("ftp://example.com/a.png", DisallowedMediaURL, "allowed_media_domains"),
    ("https://example.com/a.png", DisallowedMediaURL, "allowed_media_domains"),
])
def test_bad_inputs_are_refused_naming_the_problem(url: str, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        load_image(url, POLICY)


def test_too_many_bytes_are_refused_before_decoding() -> None:
    data = _encoded("PNG", size=(64, 64))
    with pytest.raises(MediaTooLarge, match="bytes"):
        load_image(_data_url(data), MediaPolicy(max_bytes=len(data) - 1))


class _Handler(http.server.BaseHTTPRequestHandler):
    png = _encoded("PNG")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/a.png":
            self._send(200, self.png)
        elif self.path == "/big.png":
            self._send(200, self.png + b"\0" * 4096)
        elif self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.path.split("?to=", 1)[1])
            self.end_headers()
        elif self.path == "/slow.png":
            time.sleep(1.0)
            self._send(200, self.png)
        else:
            self._send(404, b"no")

    def _send(self, code: int, body: bytes) -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (the timeout test)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_urls_load_only_from_allowed_hosts(server: str) -> None:
    allowed = MediaPolicy(allowed_domains=("127.0.0.1",))
    assert mm_hash(load_image(f"{server}/a.png", allowed)) == mm_hash(load_image(_data_url(_encoded("PNG")), POLICY))
    with pytest.raises(DisallowedMediaURL):
        load_image(f"{server}/a.png", MediaPolicy(allowed_domains=("example.com",)))
    # A redirect within the list is followed; one off it is refused, not followed.
    assert load_image(f"{server}/redirect?to={server}/a.png", allowed).size == (5, 3)
    port = server.rsplit(":", 1)[1]
    with pytest.raises(DisallowedMediaURL, match="redirects"):
        load_image(f"{server}/redirect?to=http://localhost:{port}/a.png", allowed)


def test_fetch_failures_are_named(server: str) -> None:
    allowed = MediaPolicy(allowed_domains=("127.0.0.1",), timeout_s=0.3)
    with pytest.raises(MediaFetchError, match="404"):
        load_image(f"{server}/missing.png", allowed)
    with pytest.raises(MediaFetchError, match="could not be fetched"):
        load_image(f"{server}/slow.png", allowed)
    with pytest.raises(MediaTooLarge, match="bytes"):
        load_image(f"{server}/big.png", MediaPolicy(allowed_domains=("127.0.0.1",),
                                                      max_bytes=len(_Handler.png) + 100))
