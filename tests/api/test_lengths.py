"""Lengths from the model and the data in the Python APIs (issue 38), and the clipped-responses warning."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

import hybridflow
from hybridflow.api.lengths import default_response_length, prompt_cap
from hybridflow.config import load_config
from hybridflow.data import RLDataset
from hybridflow.models import build_tiny_model_and_tokenizer, load_tokenizer
from hybridflow.trainer.metrics import ClipWatch
from hybridflow.utils.errors import UserError

LONG = "Please read this whole paragraph carefully before you answer. " * 9  # ~560 characters: over the cap


def _prompts(seed: int = 3) -> list[list[dict]]:
    """Chat prompts of 20-300 characters, and one longer than a 512-position model can take with a response."""
    rng = random.Random(seed)
    out = [[{"role": "user", "content": "word " * rng.randint(4, 60)}] for _ in range(5)]
    out.insert(2, [{"role": "user", "content": LONG}])
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lengths") / "m"
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=1)  # 512 positions
    return out


def test_the_defaults_and_the_cap() -> None:
    assert default_response_length(None) == 512 and default_response_length(4096) == 512
    assert default_response_length(512) == 256  # half the positions, not all of them
    assert prompt_cap(512, 16) == 496 and prompt_cap(None, 16) is None
    with pytest.raises(
        UserError, match=r"data.max_response_length=512 leaves no room for a prompt in the model's 512"
    ):
        prompt_cap(512, 512)
    cli = load_config(None)  # the CLI and the config keep their explicit values
    assert (cli.data.max_prompt_length, cli.data.max_response_length) == (128, 64)


def test_clip_watch_says_it_once(caplog) -> None:
    watch = ClipWatch(64)
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.metrics"):
        watch.update({"response_length/clip_ratio": 0.25})
        assert not caplog.records  # a quarter is not most of the time
        for _ in range(3):
            watch.update({"response_length/clip_ratio": 1.0})
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "data.max_response_length=64" in messages[0], messages
    assert "response_length/clip_ratio" in messages[0]


def test_rltrainer_sizes_the_prompt_length_from_the_data(model_dir: Path, tmp_path: Path, caplog) -> None:
    prompts = _prompts()
    trainer = hybridflow.RLTrainer(
        model_name=str(model_dir),
        reward_fn=lambda text: float(len(text) % 2),
        max_steps=1,
        num_generations=2,
        max_completion_length=16,
        output_dir=tmp_path / "run",
        overrides=["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"],
    )
    assert trainer.cfg.data.max_response_length == 16
    with caplog.at_level(logging.INFO):
        history = trainer.train(prompts)
    rows = [{"prompt": p, "data_source": "mine"} for p in prompts]
    tokenizer = load_tokenizer(str(model_dir))
    kept = RLDataset(
        rows, tokenizer, max_prompt_length=496, filter_overlong_prompts=True, require_ground_truth=False
    )
    longest = max(len(item["input_ids"]) for item in kept.items)
    assert len(kept) == 5 and trainer.cfg.data.max_prompt_length == longest < 496
    text = caplog.text
    assert "filtered out 1 of 6 prompts longer than 496 tokens" in text
    assert f"data.max_prompt_length={longest}: the longest prompt of a list of 6 rows" in text
    assert "512 positions minus data.max_response_length=16" in text
    assert "run: 5 prompts from a list of 6 rows" in text
    # a random tiny model rarely stops by itself: most responses hit the limit, and the run says so once
    assert history[0]["response_length/clip_ratio"] > 0.5
    assert text.count("stopped at data.max_response_length=16 tokens") == 1


def test_a_length_the_user_sets_is_kept(model_dir: Path, tmp_path: Path) -> None:
    trainer = hybridflow.RLTrainer(
        model_name=str(model_dir),
        reward_fn=lambda text: 1.0,
        max_prompt_length=400,
        output_dir=tmp_path / "run",
        overrides=["data.max_response_length=24"],
    )
    assert (trainer.cfg.data.max_prompt_length, trainer.cfg.data.max_response_length) == (400, 24)
    with pytest.raises(UserError, match=r"row 2: prompt has \d+ tokens, more than max_prompt_length=400"):
        trainer.train(_prompts())  # the user's limit keeps the config's rule: refused, naming the row


def test_the_step_wise_trainer_caps_prompts_at_the_models_positions(
    model_dir: Path, tmp_path: Path, caplog
) -> None:
    with hybridflow.Trainer(
        actor_model=str(model_dir),
        num_generations=2,
        max_completion_length=16,
        output_dir=tmp_path / "run",
    ) as trainer:
        assert trainer.cfg.data.max_prompt_length == 512 - 16
        with caplog.at_level(logging.INFO):
            responses = trainer.generate(_prompts())
        assert responses.prompt_index == [0, 0, 1, 1, 3, 3, 4, 4, 5, 5]  # prompt 2 is over the cap
        assert "filtered out 1 of 6 prompts longer than 496 tokens" in caplog.text
