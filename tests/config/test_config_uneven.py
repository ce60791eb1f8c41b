"""Issue 38: a batch that is no whole number of mini-batches is refused with the nearest valid sizes, and a
training view that does not fit the ranks is reported under the field that breaks it, with a fix that works."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.config.errors import Problem


def problems(overrides: list[str]) -> list[Problem]:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    return info.value.problems


# --- mini-batches ---------------------------------------------------------------------------------------


def test_1025_prompts_in_mini_batches_of_16_are_refused_with_the_nearest_sizes() -> None:
    overrides = ["data.train_batch_size=1025", "actor.ppo_mini_batch_size=16"]
    (problem,) = problems(overrides)
    assert str(problem) == (
        "data.train_batch_size: 1025 prompts is not a whole number of mini-batches of actor.ppo_mini_batch_size=16: "
        "the last optimizer step would see 1 prompt instead of 16; fix: set data.train_batch_size=1024 or 1040 "
        "(whole mini-batches of 16), or actor.ppo_mini_batch_size=5 or 25 (divisors of 1025)"
    )
    for size in ("1024", "1040"):
        assert load_config(
            overrides=[*overrides, f"data.train_batch_size={size}"]
        ).data.train_batch_size == int(size)
    for mini in ("5", "25"):
        load_config(overrides=[*overrides, f"actor.ppo_mini_batch_size={mini}"])


def test_the_suggested_mini_batches_split_over_the_ranks() -> None:
    # 8 ranks, rollout.n=1: a mini-batch must hold a multiple of 8 samples, so 24 prompts offer 8 and 24
    overrides = [
        "trainer.n_gpus_per_node=8",
        "rollout.n=1",
        "data.train_batch_size=24",
        "actor.ppo_mini_batch_size=16",
        "actor.ppo_micro_batch_size_per_gpu=1",
    ]
    (problem,) = problems(overrides)
    assert problem.fix.endswith("or actor.ppo_mini_batch_size=8 or 24 (divisors of 24)")
    load_config(overrides=[*overrides, "actor.ppo_mini_batch_size=8"])


def test_the_critics_own_mini_batch_is_checked_too() -> None:
    overrides = ["algorithm.adv_estimator=gae", "data.train_batch_size=16", "critic.ppo_mini_batch_size=6"]
    (problem,) = problems(overrides)
    assert problem.path == "data.train_batch_size"
    assert (
        "mini-batches of critic.ppo_mini_batch_size=6: the last optimizer step would see 4 prompts"
        in problem.message
    )
    assert problem.fix == (
        "set data.train_batch_size=12 or 18 (whole mini-batches of 6), or critic.ppo_mini_batch_size=4 or 8 "
        "(divisors of 16)"
    )
    load_config(overrides=[*overrides, "critic.ppo_mini_batch_size=8"])


def test_a_null_critic_mini_batch_is_the_actors_and_reported_once() -> None:
    overrides = ["algorithm.adv_estimator=gae", "data.train_batch_size=20", "actor.ppo_mini_batch_size=8"]
    assert [p.message.split(":")[0] for p in problems(overrides)] == [
        "20 prompts is not a whole number of mini-batches of actor.ppo_mini_batch_size=8"
    ]


def test_whole_mini_batches_pass() -> None:
    cfg = load_config(overrides=["data.train_batch_size=64", "actor.ppo_mini_batch_size=16"])
    assert cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size == 4


# --- training views ---------------------------------------------------------------------------------------

VIEWS = [
    # (overrides, the field reported, the start of its message)
    (["actor.pipeline_parallel_size=2"], "actor.pipeline_parallel_size", "2 does not divide the 1 rank "),
    (["actor.tensor_parallel_size=2"], "actor.tensor_parallel_size", "2 does not divide the 1 rank "),
    (["critic.pipeline_parallel_size=2"], "critic.pipeline_parallel_size", "2 does not divide the 1 rank "),
    (["ref.pipeline_parallel_size=2"], "ref.pipeline_parallel_size", "2 does not divide the 1 rank "),
    (
        ["ref.tensor_parallel_size=3", "trainer.n_gpus_per_node=2"],
        "ref.tensor_parallel_size",
        "3 does not divide the 2 ranks ",
    ),
    (
        ["trainer.n_gpus_per_node=4", "actor.tensor_parallel_size=2", "actor.pipeline_parallel_size=4"],
        "actor.pipeline_parallel_size",
        "4 x actor.tensor_parallel_size=2 does not divide the 4 ranks ",
    ),
    (
        ["trainer.n_gpus_per_node=4", "actor.tensor_parallel_size=3", "actor.pipeline_parallel_size=2"],
        "actor.tensor_parallel_size",
        "3 x actor.pipeline_parallel_size=2 does not divide the 4 ranks ",
    ),
    (
        ["actor.ulysses_sequence_parallel_size=2", "model.use_remove_padding=true"],
        "actor.ulysses_sequence_parallel_size",
        "2 does not divide the 1 rank ",
    ),
    (
        [
            "algorithm.adv_estimator=gae",
            "critic.ulysses_sequence_parallel_size=2",
            "critic.model.use_remove_padding=true",
        ],
        "critic.ulysses_sequence_parallel_size",
        "2 does not divide the 1 rank ",
    ),
]


@pytest.mark.parametrize(("overrides", "field", "message"), VIEWS)
def test_a_view_is_reported_under_the_field_that_breaks_it_with_a_fix_that_works(
    overrides: list[str], field: str, message: str
) -> None:
    (problem,) = problems(overrides)
    assert problem.path == field and problem.message.startswith(message)
    assert "or run on a multiple of" in problem.fix
    first = problem.fix.removeprefix("use one of [").split(",")[0].rstrip("]")  # 'use one of [1], or ...'
    load_config(overrides=[*overrides, f"{field}={first}"])


def test_the_references_inherited_sizes_are_reported_once_under_the_actor() -> None:
    # the reference's null sizes are the actor's: one problem, not a second one under ref.*
    overrides = ["actor.pipeline_parallel_size=2", "actor.use_kl_loss=true"]
    assert [p.path for p in problems(overrides)] == ["actor.pipeline_parallel_size"]
    overrides = [
        "actor.ulysses_sequence_parallel_size=2",
        "actor.use_kl_loss=true",
        "model.use_remove_padding=true",
    ]
    assert [p.path for p in problems(overrides)] == ["actor.ulysses_sequence_parallel_size"]
