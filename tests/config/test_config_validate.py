"""Validation: unknown keys, types, ranges, enums and consistency, each message naming the key and fix."""

from __future__ import annotations

import logging

import pytest
from support import cli_cases

from hybridflow.config import (
    CHOICES,
    Config,
    ConfigError,
    add_choice,
    check_config,
    load_config,
    schema_index,
    validate_config,
)
from hybridflow.config import choices as choices_module


def _error(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    return info.value


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# --- unknown keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("rollout.temprature", "rollout.temperature"),
        ("temperature", "rollout.temperature"),
        ("actor.optim.learning_rate", "actor.optim.lr"),  # found by the last component
        ("actor_rollout_ref.rollout.temprature", "actor_rollout_ref.rollout.temperature"),
        ("algorithm.adv_estimater", "algorithm.adv_estimator"),
    ],
)
def test_unknown_key_did_you_mean(key: str, suggestion: str) -> None:
    message = str(_error([f"{key}=1"]))
    assert message.startswith(f"{key}: unknown config key; fix: did you mean ")
    assert f"'{suggestion}'" in message


def test_unknown_key_without_a_close_match() -> None:
    assert str(_error(["zzz.qqq=1"])) == "zzz.qqq: unknown config key; fix: see docs/config.md for all keys"


def test_unknown_nested_yaml_key(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  nn: 4\n")
    with pytest.raises(
        ConfigError, match=r"^rollout\.nn: unknown config key; fix: did you mean 'rollout\.n'"
    ):
        load_config(str(path))


def test_section_given_a_value() -> None:
    assert str(_error(["actor.optim=3"])).startswith("actor.optim: is a section, not a value (got 3)")


def test_key_below_a_leaf_is_unknown() -> None:
    assert str(_error(["rollout.n.x=1"])).startswith("rollout.n.x: unknown config key")


# --- types --------------------------------------------------------------------------------------------


@cli_cases.sweep(lambda env, override, expected: (["config", "show", override], expected))
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "rollout.n=abc",
            "rollout.n: expected an integer, got 'abc' (str); fix: e.g. rollout.n=8 (the default)",
        ),
        ("rollout.n=2.5", "rollout.n: expected an integer, got 2.5 (float)"),
        ("rollout.do_sample=maybe", "rollout.do_sample: expected true or false, got 'maybe' (str)"),
        ("rollout.do_sample=1", "rollout.do_sample: expected true or false, got 1 (int)"),
        ("actor.optim.lr=fast", "actor.optim.lr: expected a number, got 'fast' (str)"),
        ("actor.use_kl_loss=[true]", "actor.use_kl_loss: expected true or false, got [True] (list)"),
        ("model.override_config=3", "model.override_config: expected a mapping, got 3 (int)"),
        (
            "trainer.max_ckpt_to_keep=x",
            "trainer.max_ckpt_to_keep: expected an integer or null, got 'x' (str)",
        ),
        (
            "rollout.stop_token_ids=[a]",
            "rollout.stop_token_ids: expected a list of integers, got ['a'] (list)",
        ),
    ],
)
def test_wrong_type(override: str, expected: str) -> None:
    assert str(_error([override])).startswith(expected)


# --- ranges and enums ---------------------------------------------------------------------------------


@cli_cases.sweep(lambda env, override, expected: (["config", "show", override], expected))
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.n=0", "rollout.n: must be at least 1, got 0; fix: e.g. rollout.n=8 (the default)"),
        (
            "actor.optim.lr=-1",
            "actor.optim.lr: must be 0 or more, got -1.0; fix: e.g. actor.optim.lr=1e-06",
        ),
        ("critic.optim.lr=-1e-5", "critic.optim.lr: must be 0 or more, got -1e-05"),
        ("actor.clip_ratio=-0.1", "actor.clip_ratio: must be 0 or more, got -0.1"),
        ("actor.clip_ratio_low=-0.2", "actor.clip_ratio_low: must be 0 or more, got -0.2"),
        ("actor.clip_ratio_c=1.0", "actor.clip_ratio_c: must be greater than 1, got 1.0"),
        ("rollout.temperature=-0.5", "rollout.temperature: must be 0 or more, got -0.5"),
        ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization: must be in (0, 1], got 0"),
        ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization: must be in (0, 1], got 1.5"),
        ("rollout.top_p=0", "rollout.top_p: must be in (0, 1], got 0"),
        ("rollout.top_k=-2", "rollout.top_k: must be -1 (off) or more, got -2"),
        ("algorithm.gamma=1.1", "algorithm.gamma: must be in [0, 1], got 1.1"),
        ("actor.optim.betas=[0.9,1.0]", "actor.optim.betas: must be two numbers in [0, 1), got [0.9, 1.0]"),
        (
            "algorithm.rollout_correction.rollout_token_veto_threshold=0.1",
            "algorithm.rollout_correction.rollout_token_veto_threshold: 0.1 asks for a feature hybridflow does "
            "not implement yet",
        ),
        (
            "algorithm.rollout_correction.use_pure_rollout_correction=true",
            "algorithm.rollout_correction.use_pure_rollout_correction: True asks for a feature",
        ),
    ],
)
def test_out_of_range(override: str, expected: str) -> None:
    assert str(_error([override])).startswith(expected)


@pytest.mark.parametrize("value", [1.0, 0.01])
def test_gpu_memory_utilization_bounds_that_pass(value: float) -> None:
    assert (
        load_config(overrides=[f"rollout.gpu_memory_utilization={value}"]).rollout.gpu_memory_utilization
        == value
    )


def test_unknown_enum_lists_the_valid_names() -> None:
    message = str(_error(["algorithm.adv_estimator=ppo"]))
    assert message.startswith("algorithm.adv_estimator: unknown value 'ppo'; fix: use one of: gae, grpo, ")
    for name in ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg"]:
        assert name in message


@cli_cases.sweep(lambda env, override, path: (["config", "show", override], f"{path}: unknown value"))
@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("actor.loss_agg_mode=mean", "actor.loss_agg_mode"),
        ("actor.policy_loss.loss_mode=ppo", "actor.policy_loss.loss_mode"),
        ("actor.kl_loss_type=k4", "actor.kl_loss_type"),
        ("trainer.logger=[console,mlflow]", "trainer.logger"),
        ("trainer.device=tpu", "trainer.device"),
        ("reward.on_error=ignore", "reward.on_error"),
        ("algorithm.rollout_correction.rollout_is=seq", "algorithm.rollout_correction.rollout_is"),
    ],
)
def test_other_enums(override: str, path: str) -> None:
    assert str(_error([override])).startswith(f"{path}: unknown value")


def test_optimizer_offload_is_a_bool_or_auto_for_the_roles_beside_the_rollout() -> None:
    cfg = load_config(overrides=["actor.fsdp.optimizer_offload=auto", "critic.fsdp.optimizer_offload=auto"])
    assert (cfg.actor.fsdp.optimizer_offload, cfg.critic.fsdp.optimizer_offload) == ("auto", "auto")
    message = str(_error(["critic.fsdp.optimizer_offload=auto", "trainer.placement=split"]))
    assert message.startswith(
        "critic.fsdp.optimizer_offload: auto with trainer.placement=split; fix: use true"
    )
    message = str(_error(["ref.fsdp.optimizer_offload=auto"]))
    assert message.startswith(
        "ref.fsdp.optimizer_offload: auto has no moments to move; fix: use true or false"
    )
    message = str(_error(["actor.fsdp.optimizer_offload=sometimes"]))
    assert message.startswith(
        "actor.fsdp.optimizer_offload: unknown value 'sometimes'; fix: use true, false or auto"
    )


@pytest.mark.parametrize("name", ["low_var_kl+", "k3", "mse", "k1+"])
def test_kl_names_and_straight_through_variants(name: str) -> None:
    assert load_config(overrides=[f"actor.kl_loss_type={name}"]).actor.kl_loss_type == name


def test_all_problems_reported_at_once() -> None:
    error = _error(["rollout.n=0", "actor.optim.lr=-1", "algorithm.adv_estimator=ppo"])
    assert [p.path for p in error.problems] == ["rollout.n", "actor.optim.lr", "algorithm.adv_estimator"]
    assert str(error).startswith("3 problems in the config:\n  - rollout.n: must be at least 1")


def test_add_choice_accepts_a_custom_estimator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(CHOICES, "algorithm.adv_estimator", list(CHOICES["algorithm.adv_estimator"]))
    with pytest.raises(ConfigError):
        load_config(overrides=["algorithm.adv_estimator=my_est"])
    add_choice("algorithm.adv_estimator", "my_est")
    assert load_config(overrides=["algorithm.adv_estimator=my_est"]).algorithm.adv_estimator == "my_est"
    with pytest.raises(ValueError, match="not an enumerated config field"):
        add_choice("rollout.n", "x")
    assert "my_est" not in choices_module.ADV_ESTIMATORS  # the monkeypatched copy took the name


# --- consistency --------------------------------------------------------------------------------------


def test_batch_times_n_must_split_over_the_world() -> None:
    # 3 prompts x 1 sample = 3 samples cannot split over 2 ranks.
    overrides = [
        "data.train_batch_size=3",
        "rollout.n=1",
        "trainer.n_gpus_per_node=2",
        "actor.ppo_mini_batch_size=2",
    ]
    overrides.append("actor.ppo_micro_batch_size_per_gpu=1")
    message = str(_error(overrides).problems[0])  # the second: 3 prompts are no whole mini-batches of 2
    assert message.startswith("data.train_batch_size: 3 prompts x rollout.n=1 = 3 samples do not split over")
    assert "fix: make data.train_batch_size * rollout.n a multiple of 2" in message


def test_mini_batch_larger_than_the_batch() -> None:
    message = str(_error(["data.train_batch_size=8", "actor.ppo_mini_batch_size=16"]))
    assert message == (
        "actor.ppo_mini_batch_size: 16 prompts is larger than the batch (data.train_batch_size=8); "
        "fix: set actor.ppo_mini_batch_size <= 8"
    )


def test_mini_batch_larger_than_the_batch_even_with_dynamic_bsz() -> None:
    with pytest.raises(ConfigError, match="larger than the batch"):
        load_config(
            overrides=[
                "data.train_batch_size=8",
                "actor.ppo_mini_batch_size=16",
                "actor.use_dynamic_bsz=true",
            ]
        )


BATCH = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.n_gpus_per_node=2"]


def test_micro_batch_must_divide_the_per_gpu_mini_batch() -> None:
    # verl's normalisation by hand: 4 prompts x n=4 = 16 samples per mini-batch, over 2 ranks = 8 per GPU.
    message = str(_error([*BATCH, "actor.ppo_micro_batch_size_per_gpu=3"]))
    assert message.startswith(
        "actor.ppo_micro_batch_size_per_gpu: 3 does not divide the per-GPU mini-batch of 8 samples"
    )
    assert message.endswith("fix: use a divisor of 8, e.g. actor.ppo_micro_batch_size_per_gpu=2")
    for micro in (1, 2, 4, 8):
        assert (
            load_config(
                overrides=[*BATCH, f"actor.ppo_micro_batch_size_per_gpu={micro}"]
            ).actor.ppo_micro_batch_size_per_gpu
            == micro
        )


def test_micro_batch_is_not_checked_with_dynamic_bsz() -> None:
    cfg = load_config(
        overrides=[*BATCH, "actor.ppo_micro_batch_size_per_gpu=3", "actor.use_dynamic_bsz=true"]
    )
    assert cfg.actor.use_dynamic_bsz


def test_micro_batches_split_the_share_of_every_rank() -> None:
    # world 4: 4 prompts x n=2 = 8 samples, 2 per data-parallel rank.
    base = [
        "trainer.n_gpus_per_node=4",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=2",
    ]
    assert load_config(overrides=[*base, "actor.ppo_micro_batch_size_per_gpu=2"]).trainer.world_size == 4
    message = str(_error([*base, "actor.ppo_micro_batch_size_per_gpu=3"]))
    assert "per-GPU mini-batch of 2 samples" in message


def test_mini_batch_samples_must_split_over_data_parallel_ranks() -> None:
    # 1 prompt x n=3 = 3 samples per mini-batch cannot split over 2 ranks (the batch itself, 2 x 3 = 6, can).
    overrides = [
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=1",
        "rollout.n=3",
        "trainer.n_gpus_per_node=2",
    ]
    message = str(_error(overrides))
    assert message.startswith("actor.ppo_mini_batch_size: 1 prompts x rollout.n=3 = 3 samples do not split")


def test_critic_batches_checked_only_with_a_critic() -> None:
    bad_critic = [*BATCH, "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=3"]
    assert load_config(overrides=bad_critic).critic.ppo_micro_batch_size_per_gpu == 3  # grpo: no critic
    message = str(_error([*bad_critic, "algorithm.adv_estimator=gae"]))
    assert message.startswith(
        "critic.ppo_micro_batch_size_per_gpu: 3 does not divide the per-GPU mini-batch of 8"
    )


def test_gae_without_a_critic() -> None:
    message = str(_error(["algorithm.adv_estimator=gae", "critic.enable=false"]))
    assert message.startswith("critic.enable: algorithm.adv_estimator=gae needs a critic")


@pytest.mark.parametrize("prefix", ["rollout", "rollout.val_kwargs"])
def test_do_sample_with_temperature_zero(prefix: str) -> None:
    message = str(_error([f"{prefix}.do_sample=true", f"{prefix}.temperature=0"]))
    assert message == (
        f"{prefix}.temperature: is 0 while {prefix}.do_sample=true; "
        f"fix: set {prefix}.do_sample=false for greedy decoding, or a {prefix}.temperature > 0"
    )
    cfg = load_config(overrides=[f"{prefix}.do_sample=false", f"{prefix}.temperature=0"])
    assert cfg.rollout.temperature == 0 or cfg.rollout.val_kwargs.temperature == 0


@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        (
            ["trainer.n_gpus_per_node=4", "actor.ulysses_sequence_parallel_size=3"],
            "actor.ulysses_sequence_parallel_size: 3 does not divide the 4 ranks",
        ),
        (
            ["actor.ulysses_sequence_parallel_size=2", "model.use_remove_padding=false"],
            "actor.ulysses_sequence_parallel_size: is 2, but model.use_remove_padding is false",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ulysses_sequence_parallel_size=2"],
            "critic.ulysses_sequence_parallel_size: is 2, but critic.model.use_remove_padding is false",
        ),
        (
            [
                "trainer.n_gpus_per_node=4",
                "actor.ulysses_sequence_parallel_size=2",
                "actor.tensor_parallel_size=2",
            ],
            "actor.ulysses_sequence_parallel_size: is 2 with actor.tensor_parallel_size=2: sequence parallelism "
            "does not compose",
        ),
        (
            [
                "actor.use_kl_loss=true",
                "ref.ulysses_sequence_parallel_size=2",
                "model.use_remove_padding=false",
            ],
            "ref.ulysses_sequence_parallel_size: is 2, but model.use_remove_padding is false",
        ),
    ],
)
def test_sequence_parallel_views_that_cannot_work(overrides: list[str], start: str) -> None:
    message = str(_error(["trainer.n_gpus_per_node=2", "model.use_remove_padding=true", *overrides]))
    assert message.startswith(start), message


def test_sequence_parallelism_with_verl_keys() -> None:
    """verl's keys are aliases; the reference's null follows the actor; the critic's counts only with a critic."""
    from hybridflow.config.parallel import sequence_parallel_size

    cfg = load_config(
        overrides=[
            "trainer.n_gpus_per_node=4",
            "model.use_remove_padding=true",
            "actor.use_kl_loss=true",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "critic.ulysses_sequence_parallel_size=3",  # no critic: not checked
        ]
    )
    assert cfg.actor.ulysses_sequence_parallel_size == 2 and cfg.ref.ulysses_sequence_parallel_size is None
    assert sequence_parallel_size(cfg, "ref") == 2
    cfg = load_config(
        overrides=["trainer.n_gpus_per_node=4", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4"]
    )
    assert sequence_parallel_size(cfg, "ref") == 4  # no reference in this run: not checked


@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        (
            ["actor.fsdp.fsdp_size=2", "trainer.n_gpus_per_node=4"],
            "actor.fsdp.fsdp_size: is 2, but hybrid sharding",
        ),
        (
            ["ref.fsdp.fsdp_size=1", "trainer.n_gpus_per_node=2"],
            "ref.fsdp.fsdp_size: is 1, but hybrid sharding",
        ),
        (
            ["reward.model.enable=true", "reward.model.path=/rm", "reward.model.max_length=64"],
            "reward.model.max_length: is 64, but the reward model scores whole sequences",
        ),
        (["data.gen_batch_size=32"], "data.gen_batch_size: sets the prompts of a dynamic-sampling round"),
    ],
)
def test_settings_that_would_be_ignored_are_refused(overrides: list[str], start: str) -> None:
    assert str(_error(overrides)).startswith(start)


def test_settings_that_take_effect_pass() -> None:
    cfg = load_config(
        overrides=["actor.fsdp.fsdp_size=2", "trainer.n_gpus_per_node=2"]
    )  # the world: all ranks
    assert cfg.actor.fsdp.fsdp_size == 2
    cfg = load_config(overrides=["data.gen_batch_size=32", "algorithm.filter_groups.enable=true"])
    assert cfg.data.gen_batch_size == 32


def test_a_tensor_parallel_rollout_must_split_the_world_into_groups() -> None:
    message = str(
        _error(["trainer.n_gpus_per_node=6", "rollout.tensor_model_parallel_size=4", "rollout.n=6"])
    )
    assert message.startswith("rollout.tensor_model_parallel_size: 4 does not divide the 6 ranks")
    assert "use one of [1, 2, 3, 6]" in message
    message = str(
        _error(["trainer.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2", "rollout.engine=hf"])
    )
    assert "rollout.tensor_model_parallel_size: is 2 with rollout.engine=hf" in message
    cfg = load_config(
        overrides=["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    )
    assert cfg.rollout.tensor_model_parallel_size == 2  # verl's key


def test_experts_split_over_tp_times_a_divisor_of_the_rollout_groups() -> None:
    four = ["trainer.n_gpus_per_node=4", "trainer.device=cpu"]
    message = str(_error([*four, "rollout.tensor_model_parallel_size=2", "rollout.expert_parallel_size=3"]))
    assert message.startswith(
        "rollout.expert_parallel_size: is 3 with rollout.tensor_model_parallel_size=2 on the 4"
    )
    assert "use one of 1, 2, 4" in message
    message = str(_error([*four, "rollout.expert_parallel_size=4", "rollout.multi_turn.enable=true"]))
    assert "rollout.expert_parallel_size: is 4 > tp=1 (experts across rollout groups)" in message
    assert "set rollout.expert_parallel_size=1" in message
    gpu = str(_error(["trainer.n_gpus_per_node=4", "trainer.device=cuda", "rollout.expert_parallel_size=4"]))
    assert "runs on CPU/gloo only so far" in gpu
    for key in ("rollout.expert_parallel_size", "rollout.ep_size", "actor_rollout_ref.rollout.ep_size"):
        cfg = load_config(overrides=[*four, "rollout.tensor_model_parallel_size=2", f"{key}=4"])
        assert cfg.rollout.expert_parallel_size == 4, key  # tp=2, ep=4: both groups share the experts


def test_other_consistency_rules() -> None:
    assert str(_error(["rollout.max_model_len=100"])).startswith("rollout.max_model_len: 100 is shorter than")
    assert str(_error(["data.gen_batch_size=8", "algorithm.filter_groups.enable=true"])).startswith(
        "data.gen_batch_size: 8 is smaller than data.train_batch_size=16"
    )
    assert str(_error(["trainer.resume_mode=resume_path"])).startswith("trainer.resume_from_path: is empty")
    assert str(_error(["reward.overlong_buffer.enable=true"])).startswith(
        "reward.overlong_buffer.len: 0 must be between"
    )
    assert str(_error(["reward.model.enable=true"])).startswith("reward.model.path: is empty")


def test_warnings_are_logged_not_raised(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CLI's console logging stops propagation at 'hybridflow'; caplog listens at the root.
    monkeypatch.setattr(logging.getLogger("hybridflow"), "propagate", True)
    cfg = Config()
    cfg.rollout.n = 1
    cfg.actor.ppo_micro_batch_size_per_gpu = 1
    with caplog.at_level(logging.WARNING, logger="hybridflow.config.validate"):
        assert validate_config(cfg) == []
    assert any("rollout.n=1" in r.getMessage() for r in caplog.records)


def test_check_config_on_a_python_built_config() -> None:
    cfg = Config()
    assert check_config(cfg) is cfg
    cfg.rollout.n = 0
    with pytest.raises(ConfigError, match=r"^rollout\.n: must be at least 1"):
        check_config(cfg)


def test_every_checked_path_is_a_real_field() -> None:
    from hybridflow.config.validate import _RANGES

    leaves, _ = schema_index()
    checked = [p for paths in _RANGES.values() for p in paths] + list(CHOICES)
    assert not [p for p in checked if p not in leaves]
    assert len(checked) == len(set(checked))  # each field has one range rule


def test_async_reward_is_refused_with_a_reward_model_and_off_for_remax(caplog) -> None:
    message = str(_error(["reward.launch_async=true", "reward.model.enable=true", "reward.model.path=/m"]))
    assert message.startswith("reward.launch_async: is true with a reward model")
    assert "set reward.launch_async=false" in message
    with caplog.at_level(logging.WARNING, logger="hybridflow.config.validate"):
        cfg = load_config(overrides=["reward.launch_async=true", "algorithm.adv_estimator=remax"])
    assert cfg.reward.launch_async and "reward.launch_async is off for ReMax" in caplog.text
