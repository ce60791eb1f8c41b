"""What the builders give each job: evaluation holds the policy without training state."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.trainer.builder import build_eval_components
from hybridflow.trainer.validation import validate
from hybridflow.utils.errors import UserError


def test_evaluation_builds_a_frozen_actor_and_validates() -> None:
    model, tokenizer = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=1)
    cfg = load_config(None, ["data.task_val_size=4", "data.max_response_length=4"])
    components = build_eval_components(cfg, model, tokenizer)
    engine = components.actor.engine.engine
    assert engine.optimizer is None  # no AdamW moments: evaluation holds the weights and the rollout only
    metrics = validate(cfg, components, prefix="val-core")
    components.scorer.close()
    assert any(k.startswith("val-core/") for k in metrics)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_a_prompt_plus_response_past_the_position_limit_is_warned_at_start(caplog) -> None:
    import logging
    import types

    from hybridflow.config import load_config
    from hybridflow.trainer.builder import check_position_limit

    cfg = load_config(None, ["data.max_prompt_length=300", "data.max_response_length=800"])
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=1024))
    with caplog.at_level(logging.WARNING):
        check_position_limit(cfg, model)
    assert "data.max_prompt_length=300 + data.max_response_length=800 = 1100 tokens" in caplog.text
    assert "max_position_embeddings=1024" in caplog.text


@pytest.mark.parametrize("prompt", [1024, 4096])
def test_a_prompt_limit_the_positions_cannot_hold_is_refused_at_start(prompt: int) -> None:
    import types

    from hybridflow.config import load_config
    from hybridflow.trainer.builder import check_position_limit

    cfg = load_config(None, [f"data.max_prompt_length={prompt}", "data.max_response_length=64"])
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=1024))
    with pytest.raises(UserError, match=rf"data.max_prompt_length={prompt} is not below .*below 1024"):
        check_position_limit(cfg, model)


def test_evaluation_warns_at_start_too_when_a_prompt_plus_response_is_past_the_position_limit(caplog) -> None:
    import logging

    from hybridflow.config import load_config
    from hybridflow.models import build_tiny_model_and_tokenizer
    from hybridflow.trainer.builder import build_eval_components

    model, tokenizer = build_tiny_model_and_tokenizer(
        hidden_size=32, num_hidden_layers=1, max_position_embeddings=128
    )
    cfg = load_config(None, ["data.max_prompt_length=100", "data.max_response_length=60"])
    with caplog.at_level(logging.WARNING):
        components = build_eval_components(cfg, model, tokenizer)
    components.scorer.close()
    assert "data.max_prompt_length=100 + data.max_response_length=60 = 160 tokens" in caplog.text
    assert "max_position_embeddings=128" in caplog.text
