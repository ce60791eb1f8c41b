"""The built-in visual task ``squares``: count the squares of one colour in a small generated image.

Each image is a ``grid`` x ``grid`` board of ``cell``-pixel cells on white (3 x 3 of 28 pixels: 84 x 84, so
for a Qwen2-VL-family model each cell is exactly one merged image token and the image is 9 tokens); a few
cells hold a filled square of red, green or blue. The question asks for one colour ("How many red squares?
Answer as #### <number>."); the answer is drawn uniformly in 0..``max_count`` so that no constant answer
pays, and other colours' squares are distractors. Images are PNG bytes in the row's ``images`` column
(``[{"bytes": ...}]``, as parquet and Hugging Face datasets store them), so the rows save to parquet.

Splits follow the other built-in tasks (``data.tasks``): a stable hash of the board and the question puts
each problem in train or test, whatever the seed.
"""

from __future__ import annotations

import io
import random
from typing import Any

from hybridflow.data.task_rows import check_task_args, draw_unique, task_row
from hybridflow.utils.errors import UserError

COLORS: dict[str, tuple[int, int, int]] = {"red": (255, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 255)}
BACKGROUND = (255, 255, 255)
MARGIN = 3  # pixels of background between a square and its cell's edge
EMPTY = "."
STYLES = ("question", "short")


def draw_board(layout: str, grid: int, cell: int) -> Any:
    """The PIL image of a board: ``layout`` is one char per cell, row-major ('.' empty, else a colour's initial)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (grid * cell, grid * cell), BACKGROUND)
    draw = ImageDraw.Draw(image)
    by_initial = {name[0]: rgb for name, rgb in COLORS.items()}
    for i, char in enumerate(layout):
        if char == EMPTY:
            continue
        x, y = (i % grid) * cell, (i // grid) * cell
        draw.rectangle(
            [x + MARGIN, y + MARGIN, x + cell - 1 - MARGIN, y + cell - 1 - MARGIN], fill=by_initial[char]
        )
    return image


def png_bytes(image: Any) -> bytes:
    """The image as PNG bytes (lossless, so the colours stay exact)."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _check(grid: int, cell: int, max_count: int, max_squares: int) -> None:
    if not isinstance(grid, int) or grid < 1 or not isinstance(cell, int) or cell < 2 * MARGIN + 2:
        raise UserError(
            f"grid must be an int >= 1 and cell an int >= {2 * MARGIN + 2}, got {grid!r}, {cell!r}"
        )
    if not isinstance(max_count, int) or not 0 <= max_count <= grid * grid:
        raise UserError(f"max_count must be an int in [0, grid * grid = {grid * grid}], got {max_count!r}")
    if not isinstance(max_squares, int) or not max(max_count, 1) <= max_squares <= grid * grid:
        raise UserError(
            f"max_squares must be an int in [max(max_count, 1), grid * grid = {grid * grid}], got {max_squares!r}"
        )


def make_squares(
    size: int,
    seed: int,
    split: str = "train",
    grid: int = 3,
    cell: int = 28,
    max_count: int = 3,
    max_squares: int = 4,
    style: str = "question",
    ask: str = "red,green,blue",
) -> list[dict[str, Any]]:
    """Boards with 1..``max_squares`` squares and a question on one colour.

    ``style`` "question": 'How many red squares? Answer as #### <number>.', reference answer '#### 2';
    "short": 'red squares:', answered by the bare count '2' (a form a model trained from scratch by RL alone
    can hit; the scorer reads both). ``ask``: the colours a question may name, comma-separated (the others
    still appear as distractors); one colour makes the easiest version.

    Ground truth: the count as a str; ``extra_info`` holds the ``layout`` (one char per cell, row-major:
    '.' empty, 'r'/'g'/'b') and the asked ``color`` besides the split, index and reference answer.
    """
    check_task_args(size, split, "+")
    if style not in STYLES:
        raise UserError(f"style must be one of {STYLES}, got {style!r}")
    _check(grid, cell, max_count, max_squares)
    asked = [c.strip() for c in str(ask).split(",") if c.strip()]
    if not asked or any(c not in COLORS for c in asked):
        raise UserError(f"ask must name colours among {', '.join(COLORS)} (comma-separated), got {ask!r}")
    cells = grid * grid

    def draw(rng: random.Random) -> tuple[str, tuple[str, str, int]]:
        color = rng.choice(asked)
        count = rng.randint(0, max_count)
        others = rng.randint(max(0, 1 - count), max_squares - count)  # at least one square on the board
        places = rng.sample(range(cells), count + others)
        board = [EMPTY] * cells
        for i, place in enumerate(places):
            board[place] = color[0] if i < count else rng.choice([c for c in COLORS if c != color])[0]
        layout = "".join(board)
        return f"{layout}|{color}", (layout, color, count)

    rows = []
    for i, (layout, color, count) in enumerate(draw_unique("squares", size, seed, split, draw)):
        if style == "question":
            content, answer = f"<image>How many {color} squares? Answer as #### <number>.", f"#### {count}"
        else:
            content, answer = f"<image>{color} squares:", str(count)
        row = task_row("squares", split, i, content, str(count), answer)
        row["ability"] = "vision"
        row["images"] = [{"bytes": png_bytes(draw_board(layout, grid, cell))}]
        row["extra_info"].update(layout=layout, color=color)
        rows.append(row)
    return rows
