"""Reward functions are recognised by shape at construction; one that fits none is refused naming them."""

from __future__ import annotations

import pytest

from hybridflow.rewards import RewardManager
from hybridflow.rewards.shapes import recognise_reward
from hybridflow.utils.errors import UserError


def _score(shape, texts, truths=None, infos=None, **token_args):
    manager = RewardManager(shape.call, kind=shape.kind, fn_name=shape.name)
    scores, _ = manager.score(["src"] * len(texts), texts, truths, infos, **token_args)
    return scores


def test_one_string_is_the_response_text() -> None:
    shape = recognise_reward(lambda x: 1.0 if "Transformer" in x else 0.5)
    assert (shape.shape, shape.kind, shape.needs_ground_truth) == ("text", "naive", False)
    assert _score(shape, ["a Transformer", "an RNN"]) == [1.0, 0.5]


def test_verl_signature_by_name_and_by_position() -> None:
    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str == ground_truth)

    def positional(source, text, truth, info):
        return float(text == truth) + (info or {}).get("bonus", 0.0)

    for fn in (verl, positional):
        shape = recognise_reward(fn)
        assert (shape.shape, shape.kind, shape.needs_ground_truth) == ("verl", "naive", True)
    assert _score(recognise_reward(verl), ["4", "5"], ["4", "4"]) == [1.0, 0.0]
    assert _score(recognise_reward(positional), ["4"], ["4"], [{"bonus": 0.5}]) == [1.5]


def test_trl_batched_gets_completions_prompts_and_the_other_columns() -> None:
    seen = {}

    def trl(completions, prompts=None, **kwargs):
        seen.update(prompts=prompts, **kwargs)
        return [
            float(c[0]["content"] == s) if isinstance(c, list) else 0.25
            for c, s in zip(completions, kwargs["solution"])
        ]

    shape = recognise_reward(trl)
    assert (shape.shape, shape.kind, shape.needs_ground_truth) == ("trl", "batch", False)
    chat = [{"role": "user", "content": "2+2?"}]
    infos = [{"prompt": chat, "solution": "4"}, {"prompt": "3+3?", "solution": "6"}]
    assert _score(shape, ["4", "6"], None, infos) == [1.0, 0.25]
    assert seen["prompts"] == [chat, "3+3?"] and seen["solution"] == ["4", "6"]


def test_verl_batch_and_token_ids() -> None:
    def batch(data_sources, solution_strs, ground_truths, extra_infos):
        return [float(len(s)) for s in solution_strs]

    def tokens(prompt_ids, response_ids, tokenizer):
        return float(len(response_ids))

    assert recognise_reward(batch).kind == "batch"
    assert _score(recognise_reward(batch), ["ab", "c"], ["x", "y"]) == [2.0, 1.0]
    shape = recognise_reward(tokens)
    assert (shape.shape, shape.kind, shape.needs_ground_truth) == ("token", "token", False)
    scores = _score(shape, ["", ""], prompt_ids=[[1], [2]], response_ids=[[1, 2], [3]], tokenizer=None)
    assert scores == [2.0, 1.0]


@pytest.mark.parametrize("bad", [lambda: 1.0, lambda a, b: 1.0, "not a function"])
def test_a_function_of_no_shape_is_refused_naming_the_shapes(bad) -> None:
    with pytest.raises(UserError, match=r"completions, \*\*kwargs.*prompt_ids, response_ids, tokenizer"):
        recognise_reward(bad)
