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


def _config(**fields: object) -> object:
    import types

    return types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=1024, **fields))


@pytest.mark.parametrize("response", [1024, 100_000_000])
def test_a_response_length_no_prompt_leaves_room_for_is_refused_naming_the_fix(response: int) -> None:
    # issue 59: only a warning, then the rollout sized its buffers for 10^8 tokens (an internal error)
    from hybridflow.config import load_config
    from hybridflow.trainer.builder import check_position_limit

    cfg = load_config(None, ["data.max_prompt_length=300", f"data.max_response_length={response}"])
    with pytest.raises(UserError) as err:
        check_position_limit(cfg, _config(rope_parameters={"rope_theta": 1e4}))
    assert str(err.value).startswith(
        f"data.max_response_length={response} cannot fit in the model's position limit "
        "(max_position_embeddings=1024): the rollout stops every response where prompt plus response reach 1024"
    )
    assert (
        "set data.max_response_length=724 (the 1024 positions minus data.max_prompt_length=300) or less"
        in (str(err.value))
    )


def test_pairs_past_a_learned_position_table_are_refused_and_past_rotary_positions_warned(caplog) -> None:
    # GPT-2's positions are an embedding table: a DPO pair past it was an IndexError (an internal error)
    import logging

    from hybridflow.config import load_config
    from hybridflow.trainer.builder import check_position_limit

    cfg = load_config(None, ["data.max_prompt_length=900", "data.max_response_length=300"])
    with pytest.raises(UserError) as err:
        check_position_limit(cfg, _config(model_type="gpt2"), generated=False)
    assert str(err.value) == (
        "data.max_prompt_length=900 + data.max_response_length=300 = 1200 tokens cannot fit in the model's "
        "position limit (max_position_embeddings=1024): gpt2's positions are a learned table of 1024, so the "
        "longest pairs would have no position for their last tokens; set data.max_response_length=124 (or "
        "data.max_prompt_length=724) or less"
    )
    with caplog.at_level(logging.WARNING):
        check_position_limit(
            cfg, _config(model_type="qwen2", rope_parameters={"rope_theta": 1e4}), generated=False
        )
    assert "= 1200 tokens is more than the model's position limit" in caplog.text
    assert "run past the positions the model was trained on" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # RL: the rollout stops the responses at the limit, for any model
        check_position_limit(cfg, _config(model_type="gpt2"))
    assert "prompts longer than 724 tokens get shorter responses" in caplog.text


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
