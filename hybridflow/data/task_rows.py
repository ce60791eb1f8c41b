"""What every built-in task shares: the stable train/test split, drawing distinct problems, the row's shape.

Every problem belongs to exactly one split, decided by a stable hash of the problem itself (CRC32 of its
canonical key), not by the seed or the sizes: about one problem in five is a test problem.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from typing import Any

from hybridflow.utils.errors import UserError

TEST_BUCKETS = 5  # one problem in TEST_BUCKETS is a test problem
SPLITS = ("train", "test")
OPS = "+-*/"


def in_test_split(task: str, key: str) -> bool:
    """Whether the problem with canonical ``key`` belongs to the test split of ``task`` (stable hash)."""
    return zlib.crc32(f"{task}:{key}".encode()) % TEST_BUCKETS == 0


def check_task_args(size: int, split: str, ops: str) -> None:
    if split not in SPLITS:
        raise UserError(f"split must be 'train' or 'test', got {split!r}")
    if not isinstance(size, int) or size < 0:
        raise UserError(f"size must be a non-negative int, got {size!r}")
    if not ops or any(op not in OPS for op in ops):
        raise UserError(f"ops must be a non-empty string of operators from {OPS!r}, got {ops!r}")


def draw_unique(
    task: str, size: int, seed: int, split: str, draw: Callable[[random.Random], tuple[str, Any] | None]
) -> list[Any]:
    """Draw ``size`` distinct problems of ``split``; ``draw`` returns (key, problem) or None to reject."""
    rng = random.Random(f"{task}:{split}:{seed}")  # str seeds are stable across runs and processes
    want_test = split == "test"
    seen: set[str] = set()
    out = []
    budget = 200 * size + 1000
    while len(out) < size and budget > 0:
        budget -= 1
        drawn = draw(rng)
        if drawn is None:
            continue
        key, problem = drawn
        if key in seen or in_test_split(task, key) != want_test:
            continue
        seen.add(key)
        out.append(problem)
    if len(out) < size:
        raise UserError(
            f"{task}: could only draw {len(out)} distinct {split} problems of the {size} asked for; "
            "lower the size or make the task larger (more digits, operators or numbers)"
        )
    return out


def task_row(
    task: str, split: str, index: int, content: str, ground_truth: Any, answer: str
) -> dict[str, Any]:
    return {
        "data_source": task,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer},
    }
