"""The roles' parallel sections: one shape for actor, ref and critic, their spellings, and what is refused."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config, save_config


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    return str(info.value)


@pytest.mark.parametrize(
    "key",
    [
        "actor.parallel.tp",
        "actor.tensor_parallel_size",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    ],
)
def test_every_spelling_sets_the_sections_field(key: str, tmp_path) -> None:
    cfg = load_config(overrides=["trainer.n_gpus_per_node=4", f"{key}=2", "critic.parallel.pp=2"])
    assert cfg.actor.parallel.tp == 2 and cfg.critic.parallel.pp == 2 and cfg.ref.parallel.tp is None
    again = load_config(str(save_config(cfg, tmp_path / "config.yaml")))  # saved as the sections
    assert (
        again.actor.parallel == cfg.actor.parallel
        and "tensor_parallel_size" not in (tmp_path / "config.yaml").read_text()
    )


def test_a_problem_names_the_size_and_how_it_was_written() -> None:
    overrides = ["trainer.n_gpus_per_node=4", "actor.parallel.pp=3"]
    assert _error(overrides).startswith(
        "actor.pipeline_parallel_size (given as 'actor.parallel.pp'): 3 does not divide the 4 ranks"
    )
    overrides = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"]
    assert _error(overrides).startswith(
        "actor.tensor_parallel_size (given as 'actor_rollout_ref.actor.megatron.tensor_model_parallel_size'): 3"
    )


@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        (["actor.parallel.ep=2"], "actor.parallel.ep: 2 does not divide the 1 rank"),
        (
            ["trainer.n_gpus_per_node=4", "ref.parallel.ep=4", "ref.parallel.tp=2"],
            "ref.parallel.ep: 4 does not divide the 2 data-parallel ranks (the 4 ranks",
        ),
        (
            ["trainer.n_gpus_per_node=4", "critic.parallel.ep=2", "critic.parallel.pp=2"],
            "critic.parallel.ep: is 2 with critic.pipeline_parallel_size=2: expert parallelism does not compose",
        ),
        (["critic.parallel.tp=null"], "critic.tensor_parallel_size (given as 'critic.parallel.tp'): is null"),
        (
            ["actor.parallel.sp=0"],
            "actor.ulysses_sequence_parallel_size (given as 'actor.parallel.sp'): must be at",
        ),
        (["critic.hybrid_engine=false"], "critic.hybrid_engine: is not a key here: only the actor generates"),
    ],
)
def test_what_the_sections_cannot_do_is_refused(overrides: list[str], start: str) -> None:
    message = _error(overrides)
    assert message.startswith(start), message
    assert "fix:" in message


def test_ep_one_and_the_references_nulls_are_accepted() -> None:
    cfg = load_config(overrides=["actor.parallel.ep=1", "ref.parallel.sp=null", "actor.use_kl_loss=true"])
    assert cfg.actor.parallel.ep == 1 and cfg.ref.parallel.sp is None
