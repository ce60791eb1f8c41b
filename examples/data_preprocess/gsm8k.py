"""Convert the Hugging Face ``openai/gsm8k`` dataset into hybridflow/verl parquet files.

    pip install datasets
    python examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k

writes ``train.parquet`` and ``test.parquet`` in verl's row schema (prompt as chat messages, ground truth
the number after '####'), ready for ``data.train_files=~/data/gsm8k/train.parquet``. The full reference
solution stays in ``extra_info.answer``, which SFT uses as the response. Needs the internet once.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# GSM8K answers end with '#### 1,234'; commas are thousands separators.
_FINAL = re.compile(r"#### (-?[0-9.,]+)")


def extract_solution(answer: str) -> str:
    """The final number of a GSM8K answer ('... #### 1,234' -> '1234')."""
    match = _FINAL.search(answer)
    if match is None:
        raise ValueError(f"no '#### <number>' in the answer: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def convert_row(row: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    """One GSM8K row {'question', 'answer'} as a verl-schema row."""
    question = row["question"]
    try:
        solution = extract_solution(row["answer"])
    except ValueError as e:
        raise ValueError(f"gsm8k {split} row {index}: {e}") from None
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": split, "index": index, "answer": row["answer"], "question": question},
    }


def main() -> None:
    """Download GSM8K and write {local_dir}/{train,test}.parquet."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_dir", default="~/data/gsm8k", help="output directory")
    parser.add_argument("--hf_path", default="openai/gsm8k", help="dataset name or local copy")
    args = parser.parse_args()
    try:
        import datasets
    except ImportError:
        raise SystemExit("this script needs the 'datasets' package: pip install datasets") from None
    from hybridflow.data import save_rows

    dataset = datasets.load_dataset(args.hf_path, "main")
    out = Path(args.local_dir).expanduser()
    for split in ("train", "test"):
        rows = [convert_row(row, i, split) for i, row in enumerate(dataset[split])]
        save_rows(rows, out / f"{split}.parquet")
        print(f"wrote {len(rows)} rows to {out / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
