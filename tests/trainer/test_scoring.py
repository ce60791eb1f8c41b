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


def test_a_token_id_reward_gets_each_samples_own_prompt_and_response_ids() -> None:
    """Prompts of different lengths, left-padded: the function sees each prompt's tokens, no padding."""
    from hybridflow.engine.ops.sequences import pack_prompt_response

    seen: list[tuple[list[int], list[int]]] = []

    def by_ids(prompt_ids, response_ids, tokenizer) -> float:
        seen.append((list(prompt_ids), list(response_ids)))
        return float(len(prompt_ids))

    prompts, responses = [[7, 8, 9, 10, 11], [12], [13, 14]], [[20, 21], [22, 23, 24], [25]]
    samples = pack_prompt_response(prompts, responses, 4, pad_token_id=0)
    samples["data_source"] = np.array(["x"] * 3, dtype=object)
    samples["ground_truth"] = np.array(["1"] * 3, dtype=object)
    cfg = load_config(None, ["data.max_response_length=4"])
    scorer = Scorer(build_reward_manager(cfg, by_ids), build_char_tokenizer(), cfg)
    scores, _ = scorer.score(samples)
    assert seen == list(zip(prompts, responses))
    assert scores.tolist() == [5.0, 1.0, 2.0]
    scorer.close()


def test_a_warning_about_the_rewards_names_the_harness_that_gave_them(tmp_path) -> None:
    harness = tmp_path / "play.py"
    harness.write_text("async def episode(client, row):\n    return 1.0\n")
    cfg = load_config(None, [f"rollout.harness.module={harness}"])
    scorer = Scorer(build_reward_manager(cfg, None), build_char_tokenizer(), cfg)
    assert scorer.describe() == f"the harness {harness} (no data scored yet)"
    plain = load_config(None, [])
    assert (
        "built-in scorer"
        in Scorer(build_reward_manager(plain, None), build_char_tokenizer(), plain).describe()
    )
