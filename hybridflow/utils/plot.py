"""Line charts written as PNG with numpy and zlib only (no matplotlib): the run directory's curves.png.

A figure is a grid of panels; each panel has a title, a frame, min/max tick labels on both axes, a legend
and one or more series of ``(x, y)`` points. Text uses a built-in 5x7 bitmap font (upper case only: lower
case is drawn as upper case). Lines are drawn by dense interpolation, 2 px thick, without anti-aliasing.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

Series = Sequence[tuple[float, float | None]]
Panels = Mapping[str, Mapping[str, Series]]

WHITE = (255, 255, 255)
TEXT = (40, 40, 40)
FRAME = (150, 150, 150)
PALETTE = (  # distinct, print-friendly colours (the usual "category 10" hues)
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)

# 5x7 glyphs: 7 rows top to bottom, each row 5 bits with the most significant bit on the left.
_GLYPHS: dict[str, tuple[int, ...]] = {
    " ": (0, 0, 0, 0, 0, 0, 0),
    "0": (0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E),
    "1": (0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "2": (0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F),
    "3": (0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E),
    "4": (0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02),
    "5": (0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E),
    "6": (0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E),
    "7": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08),
    "8": (0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E),
    "9": (0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C),
    "A": (0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    "B": (0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E),
    "C": (0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E),
    "D": (0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C),
    "E": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F),
    "F": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10),
    "G": (0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F),
    "H": (0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    "I": (0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "J": (0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C),
    "K": (0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11),
    "L": (0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F),
    "M": (0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11),
    "N": (0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11),
    "O": (0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E),
    "P": (0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10),
    "Q": (0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D),
    "R": (0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11),
    "S": (0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E),
    "T": (0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04),
    "U": (0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E),
    "V": (0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04),
    "W": (0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A),
    "X": (0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11),
    "Y": (0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04),
    "Z": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F),
    ".": (0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C),
    ",": (0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08),
    "-": (0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00),
    "+": (0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00),
    "=": (0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00),
    "/": (0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00),
    "%": (0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03),
    ":": (0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00),
    "_": (0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F),
    "@": (0x0E, 0x11, 0x17, 0x15, 0x17, 0x10, 0x0F),
    "(": (0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02),
    ")": (0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08),
    "?": (0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04),
}
GLYPH_W, GLYPH_H = 5, 7
_ADVANCE = GLYPH_W + 1  # one blank column between characters


def _glyph_mask(ch: str) -> np.ndarray:
    """The (7, 5) boolean bitmap of one character ('?' for characters the font lacks)."""
    rows = _GLYPHS.get(ch.upper(), _GLYPHS["?"])
    bits = np.array(rows, dtype=np.uint8)[:, None] >> np.arange(GLYPH_W - 1, -1, -1, dtype=np.uint8)
    return (bits & 1).astype(bool)  # (7, 5)


def text_width(text: str, scale: int = 1) -> int:
    """Width in pixels of ``text`` drawn at ``scale``."""
    return max(len(text) * _ADVANCE - 1, 0) * scale


def draw_text(
    img: np.ndarray, x: int, y: int, text: str, color: tuple[int, int, int] = TEXT, scale: int = 1
) -> None:
    """Draw ``text`` into ``img`` (H, W, 3) with its top-left corner at (x, y); clipped at the borders."""
    for i, ch in enumerate(text):
        mask = _glyph_mask(ch)
        if scale > 1:
            mask = mask.repeat(scale, axis=0).repeat(scale, axis=1)  # (7s, 5s)
        _paint_mask(img, x + i * _ADVANCE * scale, y, mask, color)


def _paint_mask(img: np.ndarray, x: int, y: int, mask: np.ndarray, color: tuple[int, int, int]) -> None:
    h, w = img.shape[:2]
    y0, x0 = max(y, 0), max(x, 0)
    y1, x1 = min(y + mask.shape[0], h), min(x + mask.shape[1], w)
    if y0 >= y1 or x0 >= x1:
        return
    region = img[y0:y1, x0:x1]  # a view: painting it paints img
    region[mask[y0 - y : y1 - y, x0 - x : x1 - x]] = color


def _fill_rect(img: np.ndarray, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
    """Fill the half-open pixel box [x0, x1) x [y0, y1), clipped to the image."""
    h, w = img.shape[:2]
    img[max(y0, 0) : min(y1, h), max(x0, 0) : min(x1, w)] = color


def _fit(text: str, max_px: int, scale: int = 1) -> str:
    """Cut ``text`` so that it fits in ``max_px`` pixels, marking the cut with '..'."""
    if text_width(text, scale) <= max_px:
        return text
    keep = max(max_px // (_ADVANCE * scale) - 2, 0)
    return text[:keep] + ".."


def format_tick(v: float) -> str:
    """A short tick label: 4 significant digits, no trailing zeros, scientific only when needed."""
    if v == 0:
        return "0"
    return f"{v:.4g}"


def _finite_points(series: Series) -> np.ndarray:
    """The points as a (P, 2) float64 array; None, NaN and inf become NaN (gaps in the line)."""
    if len(series) == 0:
        return np.zeros((0, 2))
    pts = np.array([[math.nan if v is None else v for v in p] for p in series], dtype=np.float64)  # (P, 2)
    pts[~np.isfinite(pts)] = math.nan
    return pts


def _axis_range(values: np.ndarray) -> tuple[float, float]:
    """Min and max of the finite values; a constant (or single) value gets a range around it."""
    lo, hi = float(values.min()), float(values.max())
    if hi > lo:
        return lo, hi
    pad = abs(lo) * 0.1 if lo != 0 else 1.0  # avoid a zero range (division by zero when scaling)
    return lo - pad, hi + pad


def _draw_polyline(
    img: np.ndarray, px: np.ndarray, py: np.ndarray, color: tuple[int, int, int], thick: int = 2
) -> None:
    """Draw the segments between consecutive finite pixel points (NaN breaks the line), ``thick`` px wide.

    A point with no finite neighbour is drawn as a small square so that isolated values stay visible.
    """
    ok = np.isfinite(px) & np.isfinite(py)  # (P,)
    xs_all, ys_all = [], []
    for i in range(len(px) - 1):
        if ok[i] and ok[i + 1]:
            # dense interpolation: one sample per pixel along the longer axis leaves no holes
            n = int(max(abs(px[i + 1] - px[i]), abs(py[i + 1] - py[i]))) + 1
            t = np.linspace(0.0, 1.0, n + 1)  # (n+1,)
            xs_all.append(px[i] + t * (px[i + 1] - px[i]))
            ys_all.append(py[i] + t * (py[i + 1] - py[i]))
    h, w = img.shape[:2]
    for i in np.flatnonzero(ok):
        left = i > 0 and ok[i - 1]
        right = i < len(px) - 1 and ok[i + 1]
        if not (left or right):
            xi, yi = round(px[i]), round(py[i])
            _fill_rect(img, xi - 2, yi - 2, xi + 2, yi + 2, color)
    if not xs_all:
        return
    xs = np.rint(np.concatenate(xs_all)).astype(np.int64)  # (S,)
    ys = np.rint(np.concatenate(ys_all)).astype(np.int64)  # (S,)
    for dy in range(thick):
        for dx in range(thick):
            x, y = xs + dx, ys + dy
            keep = (x >= 0) & (x < w) & (y >= 0) & (y < h)
            img[y[keep], x[keep]] = color


def _draw_legend(img: np.ndarray, x0: int, x1: int, y0: int, names: list[str]) -> int:
    """Lay out a colour swatch and a name per series in rows between x0 and x1 from y0; return the end y."""
    x, y = x0, y0
    for k, name in enumerate(names):
        label = _fit(name, x1 - x0 - 10)
        w = 10 + text_width(label)
        if x > x0 and x + w > x1:  # wrap to the next row
            x, y = x0, y + 10
        _fill_rect(img, x, y + 1, x + 7, y + 6, PALETTE[k % len(PALETTE)])
        draw_text(img, x + 10, y, label)
        x += w + 12
    return y + 10 if names else y


def _draw_panel(
    img: np.ndarray, box: tuple[int, int, int, int], title: str, series: Mapping[str, Series]
) -> None:
    """Draw one panel (title, frame, ticks, lines, legend) inside the pixel box (x0, y0, x1, y1)."""
    bx0, by0, bx1, by1 = box
    draw_text(img, bx0 + 8, by0 + 6, _fit(title, bx1 - bx0 - 16, 2), scale=2)
    legend_end = _draw_legend(img, bx0 + 8, bx1 - 8, by0 + 26, list(series))
    data = {name: _finite_points(pts) for name, pts in series.items()}
    stacked = np.concatenate([p for p in data.values() if len(p)] or [np.zeros((0, 2))])  # (P, 2)
    finite = stacked[np.isfinite(stacked).all(axis=1)]
    if len(finite):
        (x_lo, x_hi), (y_lo, y_hi) = _axis_range(finite[:, 0]), _axis_range(finite[:, 1])
        y_labels = [format_tick(y_hi), format_tick(y_lo)]
    else:
        y_labels = ["0"]
    # plot area: title and legend above, y tick labels on the left, x tick labels below
    ax0 = bx0 + 12 + max(text_width(s) for s in y_labels)
    ax1, ay0, ay1 = bx1 - 12, legend_end + 4, by1 - 16
    if ax1 - ax0 < 20 or ay1 - ay0 < 20:
        return  # too small to draw anything useful
    _fill_rect(img, ax0, ay0, ax1 + 1, ay0 + 1, FRAME)
    _fill_rect(img, ax0, ay1, ax1 + 1, ay1 + 1, FRAME)
    _fill_rect(img, ax0, ay0, ax0 + 1, ay1 + 1, FRAME)
    _fill_rect(img, ax1, ay0, ax1 + 1, ay1 + 1, FRAME)
    if not len(finite):
        draw_text(img, (ax0 + ax1 - text_width("NO DATA")) // 2, (ay0 + ay1) // 2 - 3, "NO DATA", FRAME)
        return
    draw_text(img, bx0 + 8, ay0, y_labels[0])
    draw_text(img, bx0 + 8, ay1 - GLYPH_H, y_labels[1])
    draw_text(img, ax0, ay1 + 4, format_tick(x_lo))
    x_hi_label = format_tick(x_hi)
    draw_text(img, ax1 - text_width(x_hi_label), ay1 + 4, x_hi_label)
    # inner padding of 4 px keeps lines off the frame; pixel y grows downwards, values grow upwards
    ix0, ix1, iy0, iy1 = ax0 + 4, ax1 - 5, ay0 + 4, ay1 - 5
    for k, pts in enumerate(data.values()):
        if len(pts):
            px = ix0 + (pts[:, 0] - x_lo) / (x_hi - x_lo) * (ix1 - ix0)  # (P,)
            py = iy1 - (pts[:, 1] - y_lo) / (y_hi - y_lo) * (iy1 - iy0)  # (P,)
            _draw_polyline(img, px, py, PALETTE[k % len(PALETTE)])


def render_line_charts(
    panels: Panels, title: str | None = None, width: int = 1200, height: int | None = None
) -> np.ndarray:
    """Render the panels in a grid and return the RGB image as a (H, W, 3) uint8 array.

    ``panels`` maps a panel title to ``{series name: [(x, y), ...]}``; y may be None or NaN (a gap).
    ``height`` defaults to 300 px per row of panels (plus the title bar).
    """
    if not panels:
        raise ValueError(
            "render_line_charts needs at least one panel, e.g. {'reward': {'score': [(1, 0.5)]}}"
        )
    n = len(panels)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    head = 30 if title else 0
    height = height if height is not None else head + 300 * rows
    if width < 100 * cols or height - head < 80 * rows:
        raise ValueError(f"a {width}x{height} image is too small for {n} panels; pass a larger width/height")
    img = np.full((height, width, 3), WHITE, dtype=np.uint8)  # (H, W, 3)
    if title:
        draw_text(img, 8, 8, _fit(title, width - 16, 2), scale=2)
    cell_w, cell_h = width // cols, (height - head) // rows
    for i, (name, series) in enumerate(panels.items()):
        r, c = divmod(i, cols)
        x0, y0 = c * cell_w, head + r * cell_h
        _draw_panel(img, (x0, y0, x0 + cell_w, y0 + cell_h), name, series)
    return img


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF  # the CRC covers the chunk type and its data
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def encode_png(img: np.ndarray) -> bytes:
    """Encode a (H, W, 3) uint8 RGB image as PNG bytes (8-bit truecolour, filter type 0 on every row)."""
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise TypeError(f"encode_png takes a (H, W, 3) uint8 array, got {img.dtype} {tuple(img.shape)}")
    h, w = img.shape[:2]
    raw = np.zeros((h, 1 + 3 * w), dtype=np.uint8)  # (H, 1 + 3W): a leading 0 = filter "none" per row
    raw[:, 1:] = img.reshape(h, 3 * w)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # bit depth 8, colour type 2 (RGB), no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
        + _png_chunk(b"IEND", b"")
    )


def save_line_charts(
    path: str | Path, panels: Panels, title: str | None = None, width: int = 1200, height: int | None = None
) -> Path:
    """Render the panels (see ``render_line_charts``) and write them to ``path`` as a PNG; returns the path.

    The file is written to a temporary name and renamed, so a viewer never sees a half-written image.
    """
    path = Path(path)
    data = encode_png(render_line_charts(panels, title=title, width=width, height=height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes the file private; a plot is meant to be read by anyone
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
