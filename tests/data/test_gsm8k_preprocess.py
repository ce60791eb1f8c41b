"""examples/data_preprocess/gsm8k.py: the pure row conversion, on rows written here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hybridflow.data import RLDataset, load_rows, save_rows

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data_preprocess" / "gsm8k.py"


@pytest.fixture(scope="module")
def gsm8k():
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROWS = [
    {
        "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
        "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
    },
    {"question": "A car costs $1,200 plus $34. What is the total?", "answer": "1200+34=1234\n#### 1,234"},
    {"question": "It is 2 degrees and drops by 7. What is it now?", "answer": "2-7=-5\n#### -5"},
]


def test_convert_row(gsm8k) -> None:
    row = gsm8k.convert_row(ROWS[0], 0, "train")
    assert row == {
        "data_source": "openai/gsm8k",
        "prompt": [
            {
                "role": "user",
                "content": "Tom has 3 apples and buys 4 more. How many apples does he have? "
                'Let\'s think step by step and output the final answer after "####".',
            }
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {
            "split": "train",
            "index": 0,
            "answer": ROWS[0]["answer"],
            "question": ROWS[0]["question"],
        },
    }
    assert gsm8k.convert_row(ROWS[1], 1, "test")["reward_model"]["ground_truth"] == "1234"
    assert gsm8k.convert_row(ROWS[2], 2, "test")["reward_model"]["ground_truth"] == "-5"
    with pytest.raises(ValueError, match="gsm8k train row 5: no '#### <number>'"):
        gsm8k.convert_row({"question": "q", "answer": "no final line"}, 5, "train")


def test_converted_rows_load_as_a_dataset(gsm8k, tmp_path: Path, tok) -> None:
    rows = [gsm8k.convert_row(r, i, "test") for i, r in enumerate(ROWS)]
    save_rows(rows, tmp_path / "test.parquet")
    ds = RLDataset(load_rows(tmp_path / "test.parquet"), tok, max_prompt_length=256)
    assert [it["ground_truth"] for it in ds] == ["7", "1234", "-5"]
    assert ds.data_sources() == ["openai/gsm8k"]
