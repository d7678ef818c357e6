"""Charts as PNG files with the standard library only (zlib + struct): every
benchmark's plots, on boxes without matplotlib (the project's venv has none,
nor do the peers'). Line charts with several series, vertical event markers,
horizontal reference lines, numbered or labelled x ticks, a small bitmap font
for the text; several charts side by side in one file.

  line_chart(path, xs, ys, events=[(x, (r, g, b))], title="...", xlabel="s", ylabel="tok/s")
  save_charts(path, [Chart(title, series=[Series("ours", xs, ys)]), ...], cols=2)
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

Color = tuple[int, int, int]
PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40),
                              (148, 103, 189), (140, 86, 75))
# 3x5 glyphs, rows top to bottom, 3 bits each (4 = left pixel).
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 2, 2, 2),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
    "/": (1, 1, 2, 4, 4), " ": (0, 0, 0, 0, 0), ":": (0, 2, 0, 2, 0), "(": (2, 4, 4, 4, 2),
    ")": (2, 1, 1, 1, 2), ",": (0, 0, 0, 2, 4), "=": (0, 7, 0, 7, 0), "+": (0, 2, 7, 2, 0),
    "_": (0, 0, 0, 0, 7), "%": (5, 1, 2, 4, 5), "<": (1, 2, 4, 2, 1), ">": (4, 2, 1, 2, 4),
    "a": (2, 5, 7, 5, 5), "b": (6, 5, 6, 5, 6), "c": (7, 4, 4, 4, 7), "d": (6, 5, 5, 5, 6),
    "e": (7, 4, 6, 4, 7), "f": (7, 4, 6, 4, 4), "g": (7, 4, 5, 5, 7), "h": (5, 5, 7, 5, 5),
    "i": (7, 2, 2, 2, 7), "j": (1, 1, 1, 5, 7), "k": (5, 5, 6, 5, 5), "l": (4, 4, 4, 4, 7),
    "m": (5, 7, 7, 5, 5), "n": (6, 5, 5, 5, 5), "o": (7, 5, 5, 5, 7), "p": (7, 5, 7, 4, 4),
    "q": (7, 5, 5, 7, 1), "r": (6, 5, 6, 5, 5), "s": (7, 4, 7, 1, 7), "t": (7, 2, 2, 2, 2),
    "u": (5, 5, 5, 5, 7), "v": (5, 5, 5, 5, 2), "w": (5, 5, 7, 7, 5), "x": (5, 5, 2, 5, 5),
    "y": (5, 5, 2, 2, 2), "z": (7, 1, 2, 4, 7),
}


@dataclass
class Series:
    """One line: its legend label, points and colour (None: the next of PALETTE)."""
    label: str
    xs: list[float]
    ys: list[float]
    color: Color | None = None


@dataclass
class Chart:
    """One panel: lines, dashed vertical events (x, colour), dotted
    horizontal references (y, colour), extra legend rows, and category names
    for x = 0, 1, 2, ... (None: numbered ticks)."""
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    series: list[Series] = field(default_factory=list)
    events: list[tuple[float, Color]] = field(default_factory=list)
    hlines: list[tuple[float, Color]] = field(default_factory=list)
    legend: list[tuple[str, Color]] = field(default_factory=list)
    categories: list[str] | None = None


class Canvas:
    """An RGB pixel buffer with lines, text and PNG output."""

    def __init__(self, w: int, h: int, bg: Color = (255, 255, 255)) -> None:
        self.w, self.h = w, h
        self.px = [bytearray(bytes(bg) * w) for _ in range(h)]

    def dot(self, x: int, y: int, c: Color) -> None:
        """One pixel (ignored outside the canvas)."""
        if 0 <= x < self.w and 0 <= y < self.h:
            self.px[y][3 * x:3 * x + 3] = bytes(c)

    def line(self, x0: int, y0: int, x1: int, y1: int, c: Color, dash: int = 0) -> None:
        """A straight line (dash: on/off runs of that many pixels)."""
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            if dash and (k // dash) % 2:
                continue
            self.dot(round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n), c)

    def text(self, x: int, y: int, s: str, c: Color = (0, 0, 0), scale: int = 2) -> None:
        """Text in the 3x5 font, lower case, scale pixels per font pixel."""
        for ch in s.lower():
            for r, bits in enumerate(_FONT.get(ch, _FONT[" "])):
                for col in range(3):
                    if bits & (4 >> col):
                        for dy in range(scale):
                            for dx in range(scale):
                                self.dot(x + col * scale + dx, y + r * scale + dy, c)
            x += 4 * scale

    def save(self, path: str) -> None:
        """Write the canvas as an 8-bit RGB PNG."""
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


def draw(cv: Canvas, ch: Chart, ox: int, oy: int, w: int, h: int) -> None:
    """Draw one chart into the w x h box at (ox, oy) of the canvas."""
    L, R, T, B = 70, 20, 52, 50
    xs_all = [x for s in ch.series for x in s.xs] + [x for x, _ in ch.events]
    ys_all = [y for s in ch.series for y in s.ys] + [y for y, _ in ch.hlines]
    xmax = max(xs_all, default=1.0) or 1.0
    ymax = max(ys_all, default=1.0) * 1.1 or 1.0

    def px(x: float) -> int:
        return ox + L + round((w - L - R) * x / xmax)

    def py(y: float) -> int:
        return oy + h - B - round((h - T - B) * y / ymax)
    grey, black = (200, 200, 200), (0, 0, 0)
    for y in _ticks(ymax):
        cv.line(ox + L, py(y), ox + w - R, py(y), grey)
        cv.text(ox + L - 6 - 8 * len(f"{y:g}"), py(y) - 5, f"{y:g}")
    ticks = list(enumerate(ch.categories)) if ch.categories else [(x, f"{x:g}") for x in _ticks(xmax, 10)]
    for x, lab in ticks:
        cv.line(px(x), oy + h - B, px(x), oy + h - B + 5, black)
        cv.text(px(x) - 4 * len(lab), oy + h - B + 9, lab)
    cv.line(ox + L, oy + T, ox + L, oy + h - B, black)
    cv.line(ox + L, oy + h - B, ox + w - R, oy + h - B, black)
    for x, c in ch.events:
        cv.line(px(x), oy + T, px(x), oy + h - B, c, dash=4)
    for y, c in ch.hlines:
        cv.line(ox + L, py(y), ox + w - R, py(y), c, dash=2)
    legend = list(ch.legend)
    for k, s in enumerate(ch.series):
        color = s.color or PALETTE[k % len(PALETTE)]
        pts = [(px(x), py(y)) for x, y in zip(s.xs, s.ys)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            for d in (0, 1):
                cv.line(x0, y0 + d, x1, y1 + d, color)
        for x, y in pts if len(pts) < 30 else []:
            for d in range(-2, 3):
                cv.line(x - 2, y + d, x + 2, y + d, color)
        if s.label:
            legend.append((s.label, color))
    cv.text(ox + L, oy + 12, ch.title)
    cv.text(ox + (w - 8 * len(ch.xlabel)) // 2, oy + h - 20, ch.xlabel)
    cv.text(ox + 4, oy + T - 16, ch.ylabel)
    lx = ox + w - R - 220
    for k, (lab, c) in enumerate(legend):
        cv.line(lx, oy + T + 8 + 16 * k, lx + 20, oy + T + 8 + 16 * k, c)
        cv.text(lx + 28, oy + T + 3 + 16 * k, lab, c)


def save_charts(path: str, charts: list[Chart], cols: int = 1, w: int = 1000, h: int = 430) -> None:
    """Charts in a grid of ``cols`` columns, each w x h pixels, into one PNG."""
    rows = (len(charts) + cols - 1) // cols
    cv = Canvas(w * min(cols, len(charts)), h * rows)
    for i, ch in enumerate(charts):
        draw(cv, ch, (i % cols) * w, (i // cols) * h, w, h)
    cv.save(path)


def line_chart(path: str, xs: list[float], ys: list[float], events: list[tuple[float, Color]],
               title: str = "", xlabel: str = "", ylabel: str = "",
               legend: list[tuple[str, Color]] | None = None,
               hlines: list[tuple[float, Color]] | None = None) -> None:
    """One series over time (xs ascending) with dashed event markers."""
    save_charts(path, [Chart(title, xlabel, ylabel, [Series("", xs, ys)], events, hlines or [],
                             legend or [])])
