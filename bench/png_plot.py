"""A line chart as a PNG with the standard library only (zlib + struct), for
benchmarks on boxes without matplotlib: one series, vertical event markers,
axes with numbered ticks and a small bitmap font for labels.

  line_chart(path, xs, ys, events=[(x, (r, g, b))], title="...", xlabel="s", ylabel="tok/s")
"""
from __future__ import annotations

import struct
import zlib

Color = tuple[int, int, int]
# 3x5 glyphs, rows top to bottom, 3 bits each (4 = left pixel).
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 2, 2, 2),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
    "/": (1, 1, 2, 4, 4), " ": (0, 0, 0, 0, 0), ":": (0, 2, 0, 2, 0), "(": (2, 4, 4, 4, 2),
    ")": (2, 1, 1, 1, 2), ",": (0, 0, 0, 2, 4), "=": (0, 7, 0, 7, 0), "+": (0, 2, 7, 2, 0),
    "a": (2, 5, 7, 5, 5), "b": (6, 5, 6, 5, 6), "c": (7, 4, 4, 4, 7), "d": (6, 5, 5, 5, 6),
    "e": (7, 4, 6, 4, 7), "f": (7, 4, 6, 4, 4), "g": (7, 4, 5, 5, 7), "h": (5, 5, 7, 5, 5),
    "i": (7, 2, 2, 2, 7), "j": (1, 1, 1, 5, 7), "k": (5, 5, 6, 5, 5), "l": (4, 4, 4, 4, 7),
    "m": (5, 7, 7, 5, 5), "n": (6, 5, 5, 5, 5), "o": (7, 5, 5, 5, 7), "p": (7, 5, 7, 4, 4),
    "q": (7, 5, 5, 7, 1), "r": (6, 5, 6, 5, 5), "s": (7, 4, 7, 1, 7), "t": (7, 2, 2, 2, 2),
    "u": (5, 5, 5, 5, 7), "v": (5, 5, 5, 5, 2), "w": (5, 5, 7, 7, 5), "x": (5, 5, 2, 5, 5),
    "y": (5, 5, 2, 2, 2), "z": (7, 1, 2, 4, 7),
}


class Canvas:
    def __init__(self, w: int, h: int, bg: Color = (255, 255, 255)) -> None:
        self.w, self.h = w, h
        self.px = [bytearray(bytes(bg) * w) for _ in range(h)]

    def dot(self, x: int, y: int, c: Color) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            self.px[y][3 * x:3 * x + 3] = bytes(c)

    def line(self, x0: int, y0: int, x1: int, y1: int, c: Color, dash: int = 0) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            if dash and (k // dash) % 2:
                continue
            self.dot(round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n), c)

    def text(self, x: int, y: int, s: str, c: Color = (0, 0, 0), scale: int = 2) -> None:
        for ch in s.lower():
            for r, bits in enumerate(_FONT.get(ch, _FONT[" "])):
                for col in range(3):
                    if bits & (4 >> col):
                        for dy in range(scale):
                            for dx in range(scale):
                                self.dot(x + col * scale + dx, y + r * scale + dy, c)
            x += 4 * scale

    def save(self, path: str) -> None:
        raw = b"".join(b"\x00" + bytes(row) for row in self.px)
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                    + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _ticks(hi: float, n: int = 5) -> list[float]:
    step = max(hi / n, 1e-9)
    mag = 10 ** len(str(int(step))) / 10
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= step)
    return [k * step for k in range(int(hi / step) + 1)]


def line_chart(path: str, xs: list[float], ys: list[float], events: list[tuple[float, Color]],
               title: str = "", xlabel: str = "", ylabel: str = "",
               legend: list[tuple[str, Color]] | None = None) -> None:
    """xs ascending; events: vertical dashed markers at x in their colour."""
    W, H, L, R, T, B = 1000, 430, 70, 20, 52, 50
    cv = Canvas(W, H)
    xmax, ymax = max(xs, default=1.0) or 1.0, max(ys, default=1.0) * 1.1 or 1.0
    def px(x: float) -> int:
        return L + round((W - L - R) * x / xmax)
    def py(y: float) -> int:
        return H - B - round((H - T - B) * y / ymax)
    grey, black = (200, 200, 200), (0, 0, 0)
    for y in _ticks(ymax):
        cv.line(L, py(y), W - R, py(y), grey)
        lab = f"{y:g}"
        cv.text(L - 6 - 8 * len(lab), py(y) - 5, lab)
    for x in _ticks(xmax, 10):
        cv.line(px(x), H - B, px(x), H - B + 5, black)
        lab = f"{x:g}"
        cv.text(px(x) - 4 * len(lab), H - B + 9, lab)
    cv.line(L, T, L, H - B, black)
    cv.line(L, H - B, W - R, H - B, black)
    for x, c in events:
        cv.line(px(x), T, px(x), H - B, c, dash=4)
    pts = [(px(x), py(y)) for x, y in zip(xs, ys)]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        for d in (0, 1):
            cv.line(x0, y0 + d, x1, y1 + d, (31, 119, 180))
    cv.text(L, 12, title)
    cv.text((W - 8 * len(xlabel)) // 2, H - 20, xlabel)
    cv.text(4, T - 16, ylabel)
    lx = W - R - 220
    for k, (lab, c) in enumerate(legend or []):
        cv.line(lx, T + 8 + 16 * k, lx + 20, T + 8 + 16 * k, c)
        cv.text(lx + 28, T + 3 + 16 * k, lab, c)
    cv.save(path)
