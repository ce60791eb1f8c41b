"""The built-in visual task squares (hybridflow/data/squares.py): deterministic boards, answers read off pixels."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from hybridflow.config import DataConfig
from hybridflow.data import DataError, collate_prompts, make_task
from hybridflow.data.builder import build_rl_dataset
from hybridflow.data.squares import COLORS, make_squares
from hybridflow.rewards import default_compute_score
from hybridflow.utils.errors import UserError


def _pixels(row: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB"))  # (H, W, 3)


def _count_from_pixels(pixels: np.ndarray, color: str, grid: int, cell: int) -> int:
    """Squares of ``color``: cells whose centre pixel has that colour and whose corner is background."""
    count = 0
    for r in range(grid):
        for c in range(grid):
            centre = pixels[r * cell + cell // 2, c * cell + cell // 2]
            assert tuple(pixels[r * cell, c * cell]) == (255, 255, 255)  # the margin stays white
            count += tuple(centre) == COLORS[color]
    return count


def test_rows_are_deterministic_by_seed() -> None:
    """The same seed gives the same rows (image bytes included); another seed other boards."""
    a, b = make_squares(30, seed=1), make_squares(30, seed=1)
    assert a == b
    other = make_squares(30, seed=2)
    assert [r["extra_info"]["layout"] for r in other] != [r["extra_info"]["layout"] for r in a]


def test_answers_match_the_drawn_pixels() -> None:
    """Each row's ground truth is the number of squares of the asked colour in its image, 0..3 all present."""
    rows = make_task("squares", "train", 60, seed=0)
    truths = set()
    for row in rows:
        color = row["extra_info"]["color"]
        pixels = _pixels(row)
        assert pixels.shape == (84, 84, 3)
        assert f"How many {color} squares?" in row["prompt"][0]["content"]
        assert row["prompt"][0]["content"].count("<image>") == 1
        truth = int(row["reward_model"]["ground_truth"])
        assert _count_from_pixels(pixels, color, 3, 28) == truth
        assert row["extra_info"]["answer"] == f"#### {truth}"
        truths.add(truth)
    assert truths == {0, 1, 2, 3}


def test_splits_are_disjoint_whatever_the_seed() -> None:
    """No board-and-question is both a train and a test problem, across seeds and sizes."""
    key = lambda r: (r["extra_info"]["layout"], r["extra_info"]["color"])  # noqa: E731
    train = {key(r) for seed in (0, 1) for r in make_squares(200, seed, "train")}
    test = {key(r) for seed in (0, 3) for r in make_squares(50, seed, "test")}
    assert len(train) > 200 and len(test) > 50 and not train & test


def test_board_options_and_refusals() -> None:
    """A 2 x 2 board of 28-pixel cells is 56 x 56; impossible settings are refused naming them."""
    row = make_squares(5, 0, grid=2, max_count=2, max_squares=2)[0]
    assert _pixels(row).shape == (56, 56, 3) and int(row["reward_model"]["ground_truth"]) <= 2
    short = make_squares(5, 0, style="short")
    assert [r["extra_info"]["layout"] for r in short] == [
        r["extra_info"]["layout"] for r in make_squares(5, 0)
    ]
    color, truth = short[0]["extra_info"]["color"], short[0]["reward_model"]["ground_truth"]
    assert (
        short[0]["prompt"][0]["content"] == f"<image>{color} squares:"
        and short[0]["extra_info"]["answer"] == truth
    )
    with pytest.raises(UserError, match="style"):
        make_squares(5, 0, style="long")
    with pytest.raises(UserError, match="max_count"):
        make_squares(5, 0, grid=2, max_count=5)
    with pytest.raises(UserError, match="cell"):
        make_squares(5, 0, cell=4)


def test_built_in_task_through_the_processor(vl_processor) -> None:
    """data.task=squares with a VLM's processor: 9 image tokens per prompt, rewards routed by data_source."""
    data = DataConfig(task="squares", task_val_size=6, max_prompt_length=128)
    ds = build_rl_dataset(data, vl_processor.tokenizer, "val", seed=0, processor=vl_processor)
    batch = collate_prompts([ds[i] for i in range(len(ds))], vl_processor.tokenizer.pad_token_id)
    assert ((batch.tensors["input_ids"] == vl_processor.image_token_id).sum(1) == 9).all()
    assert all(mm["image_grid_thw"].tolist() == [[1, 6, 6]] for mm in batch.non_tensors["multi_modal_inputs"])
    truth = ds[0]["ground_truth"]
    assert default_compute_score(ds[0]["data_source"], f"#### {truth}", truth) == 1.0
    with pytest.raises(DataError, match=r"built-in squares \(val\): row 0: .*use a vision-language model"):
        build_rl_dataset(data, vl_processor.tokenizer, "val", seed=0)


def test_rows_round_trip_through_parquet(tmp_path) -> None:
    """The rows save to parquet and load back with the same image bytes (the images column is plain data)."""
    from hybridflow.data import load_rows, save_rows

    rows = make_squares(4, seed=0)
    save_rows(rows, tmp_path / "squares.parquet")
    loaded = load_rows(tmp_path / "squares.parquet")
    assert [r["images"][0]["bytes"] for r in loaded] == [r["images"][0]["bytes"] for r in rows]


def test_ask_limits_the_colour_asked_and_keeps_the_others_as_distractors() -> None:
    from hybridflow.data.tasks import make_task
    from hybridflow.utils.errors import UserError

    rows = make_task("squares", "train", 40, 1, style="short", ask="red")
    assert {r["prompt"][0]["content"] for r in rows} == {"<image>red squares:"}
    assert any(set(r["extra_info"]["layout"]) - {".", "r"} for r in rows)  # green and blue still drawn
    for r in rows:
        assert r["extra_info"]["layout"].count("r") == int(r["reward_model"]["ground_truth"])
    with pytest.raises(UserError, match="ask must name colours"):
        make_task("squares", "train", 4, 1, ask="purple")
