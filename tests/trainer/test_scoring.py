"""The scorer: a reward function's scores plus DAPO's overlong penalty, logged as a metric on request."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.models import build_char_tokenizer
from hybridflow.protocol import Batch
from hybridflow.trainer.scoring import Scorer, build_reward_manager


def one(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return 1.0


def batch(lengths: list[int], R: int = 8) -> Batch:
    """Responses of the given lengths (token ids of the char tokenizer) in an R-token budget."""
    mask = torch.tensor([[1] * n + [0] * (R - n) for n in lengths])  # (B, R)
    out = Batch({"responses": torch.full((len(lengths), R), 5) * mask, "response_mask": mask})
    out["data_source"] = np.array(["x"] * len(lengths), dtype=object)
    out["ground_truth"] = np.array(["1"] * len(lengths), dtype=object)
    return out


@pytest.mark.parametrize("log", [False, True])
def test_the_overlong_penalty_always_applies_and_is_logged_on_request(log: bool) -> None:
    overrides = [
        "data.max_response_length=8",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=4",
    ]
    cfg = load_config(None, [*overrides, f"reward.overlong_buffer.log={str(log).lower()}"])
    scorer = Scorer(build_reward_manager(cfg, one), build_char_tokenizer(), cfg)
    scores, extras = scorer.score(batch([2, 4, 6, 8]))
    # the buffer is the last 4 of 8 tokens: 0 up to length 4, then down by 1/4 per token to -1 at 8
    assert scores.tolist() == pytest.approx([1.0, 1.0, 0.5, 0.0])
    assert ("overlong_penalty" in extras) == log
    scorer.close()
