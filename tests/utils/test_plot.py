"""The numpy-only PNG line charts: the file decodes with an independent reader and shows what was plotted."""

import math
import struct
import zlib

import numpy as np
import pytest

from hybridflow.utils.plot import (
    PALETTE,
    draw_text,
    encode_png,
    format_tick,
    render_line_charts,
    save_line_charts,
    text_width,
)


def decode_png(data: bytes) -> np.ndarray:
    """A tiny PNG reader for 8-bit RGB, non-interlaced, filter type 0: checks every CRC; returns (H, W, 3)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    w, h, depth, colour, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all(), "only filter type 0 (none) is expected"
    return rows[:, 1:].reshape(h, w, 3)


def colour_mask(img: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    return (img == np.array(colour, dtype=np.uint8)).all(axis=-1)  # (H, W)


def test_png_round_trip_is_exact():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(7, 5, 3), dtype=np.uint8)
    assert np.array_equal(decode_png(encode_png(img)), img)


def test_encode_png_rejects_wrong_arrays():
    with pytest.raises(TypeError, match="uint8"):
        encode_png(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(TypeError, match=r"\(H, W, 3\)"):
        encode_png(np.zeros((4, 4), dtype=np.uint8))


def test_saved_file_decodes_with_requested_size_and_series_colours(tmp_path):
    panels = {
        "reward": {"score": [(1, 0.1), (2, 0.4), (3, 0.35)], "baseline": [(1, 0.2), (3, 0.3)]},
        "KL": {"kl": [(1, 0.0), (2, 1e-3)]},
    }
    path = save_line_charts(tmp_path / "sub" / "curves.png", panels, title="demo", width=640, height=360)
    assert path == tmp_path / "sub" / "curves.png"
    img = decode_png(path.read_bytes())
    assert img.shape == (360, 640, 3)
    assert PALETTE[0] != PALETTE[1]
    assert colour_mask(img, PALETTE[0]).sum() > 50  # first series of both panels
    assert colour_mask(img, PALETTE[1]).sum() > 20  # the second series of "reward"
    assert not colour_mask(img, PALETTE[2]).any()  # no panel has a third series
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temporary file left behind


def test_overwriting_replaces_the_file(tmp_path):
    path = tmp_path / "c.png"
    save_line_charts(path, {"a": {"s": [(0, 1.0), (1, 2.0)]}}, width=300, height=200)
    save_line_charts(path, {"a": {"s": [(0, 1.0), (1, 2.0)]}}, width=320, height=210)
    assert decode_png(path.read_bytes()).shape == (210, 320, 3)


def test_rising_series_goes_up_and_right():
    img = render_line_charts({"p": {"s": [(0.0, 0.0), (1.0, 1.0)]}}, width=400, height=300)
    ys, xs = np.nonzero(colour_mask(img, PALETTE[0]))
    line = ys >= 40  # skip the legend swatch under the panel title
    ys, xs = ys[line], xs[line]
    # image rows grow downwards: the leftmost line pixels must be the lowest on screen
    assert ys[xs == xs.min()].mean() > ys[xs == xs.max()].mean() + 100


def _line_columns(points):
    img = render_line_charts({"p": {"s": points}}, width=400, height=300)
    mask = colour_mask(img, PALETTE[0])
    mask[:50] = False  # drop the title/legend strip; the constant line sits mid-panel
    return np.unique(np.nonzero(mask)[1])


def test_none_nan_and_inf_leave_gaps():
    solid = _line_columns([(0, 1.0), (1, 1.0), (2, 1.0)])
    assert len(solid) == solid.max() - solid.min() + 1  # one unbroken horizontal line
    for missing in (None, math.nan, math.inf):
        gapped = _line_columns([(0, 1.0), (1, missing), (2, 1.0)])
        # two isolated points at both ends: same extent as the solid line, nothing in the middle
        assert abs(gapped.min() - solid.min()) <= 2 and abs(gapped.max() - solid.max()) <= 2
        assert len(gapped) < 12


def test_single_point_and_constant_and_empty_series_render():
    img = render_line_charts(
        {"one": {"s": [(5, 0.3)]}, "flat": {"s": [(1, 2.0), (9, 2.0)]}, "none": {"s": [], "t": [(1, None)]}},
        width=600,
        height=300,
    )
    assert np.isfinite(img).all()
    assert colour_mask(img, PALETTE[0]).sum() > 30


def test_bad_panels_raise_with_a_fix():
    with pytest.raises(ValueError, match="at least one panel"):
        render_line_charts({})
    with pytest.raises(ValueError, match="too small"):
        render_line_charts({"a": {"s": [(0, 1)]}, "b": {"s": [(0, 1)]}}, width=120, height=100)


def test_text_width_and_scaling():
    assert text_width("") == 0
    assert text_width("AB") == 5 + 1 + 5  # two 5 px glyphs with one blank column between them
    assert text_width("AB", scale=2) == 22
    small = np.zeros((20, 40, 3), dtype=np.uint8)
    draw_text(small, 0, 0, "7", color=(255, 255, 255))
    big = np.zeros((20, 40, 3), dtype=np.uint8)
    draw_text(big, 0, 0, "7", color=(255, 255, 255), scale=2)
    n_small = colour_mask(small, (255, 255, 255)).sum()
    assert n_small > 0 and colour_mask(big, (255, 255, 255)).sum() == 4 * n_small
    lower = np.zeros((20, 40, 3), dtype=np.uint8)
    draw_text(lower, 0, 0, "ab", color=(255, 255, 255))
    upper = np.zeros((20, 40, 3), dtype=np.uint8)
    draw_text(upper, 0, 0, "AB", color=(255, 255, 255))
    assert np.array_equal(lower, upper)
    draw_text(small, 36, 17, "88", color=(9, 9, 9))  # runs off the edge: clipped, no error
    assert colour_mask(small, (9, 9, 9)).any()


def test_format_tick():
    assert format_tick(0.0) == "0"
    assert format_tick(0.72) == "0.72"
    assert format_tick(-0.5) == "-0.5"
    assert format_tick(12.3456) == "12.35"
    assert format_tick(1234567.0) == "1.235e+06"


def test_pillow_reads_it_when_installed(tmp_path):
    image_mod = pytest.importorskip("PIL.Image")
    path = save_line_charts(tmp_path / "c.png", {"a": {"s": [(0, 1.0), (1, 2.0)]}}, width=300, height=200)
    with image_mod.open(path) as im:
        assert im.size == (300, 200) and im.mode == "RGB"
