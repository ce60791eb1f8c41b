"""The schema: every field documented, verl's defaults where verl has the field, derived values."""

from __future__ import annotations

import dataclasses

import pytest

from hybridflow.config import Config, schema_index
from hybridflow.config.schema import option

SECTIONS = [
    "model",
    "data",
    "rollout",
    "actor",
    "critic",
    "ref",
    "reward",
    "algorithm",
    "trainer",
    "preference",
]


def _all_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every dataclass field under Config, walked independently of schema_index."""
    out = []
    for f in dataclasses.fields(cls):
        out.append((prefix + f.name, f))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += _all_fields(type(default), prefix + f.name + ".")
    return out


def test_top_level_sections() -> None:
    assert [f.name for f in dataclasses.fields(Config)] == SECTIONS


def test_every_field_has_a_one_line_help() -> None:
    fields = _all_fields(Config)
    assert len(fields) > 150
    missing = [
        p for p, f in fields if not isinstance(f.metadata.get("help"), str) or not f.metadata["help"].strip()
    ]
    assert not missing, f"fields without help: {missing}"
    multiline = [p for p, f in fields if "\n" in f.metadata["help"] or len(f.metadata["help"]) > 110]
    assert not multiline, f"help strings must be one short line: {multiline}"


def test_schema_index_covers_every_leaf() -> None:
    leaves, sections = schema_index()
    walked = {p for p, f in _all_fields(Config)}
    assert set(leaves) | set(sections) == walked
    assert set(SECTIONS) <= set(sections)
    assert {"actor.optim", "actor.policy_loss", "algorithm.kl_ctrl", "reward.custom_function"} <= set(
        sections
    )


# verl's defaults for the fields verl has (from verl's ppo_trainer.yaml), typed in by hand.
VERL_DEFAULTS = {
    "actor.clip_ratio": 0.2,
    "actor.clip_ratio_c": 3.0,
    "actor.kl_loss_coef": 0.001,
    "actor.kl_loss_type": "low_var_kl",
    "actor.loss_agg_mode": "token-mean",
    "actor.entropy_coeff": 0.0,
    "actor.use_kl_loss": False,
    "actor.ppo_epochs": 1,
    "actor.grad_clip": 1.0,
    "actor.use_dynamic_bsz": False,
    "actor.ppo_max_token_len_per_gpu": 16384,
    "actor.parallel.sp": 1,  # verl: actor.ulysses_sequence_parallel_size
    "actor.optim.lr": 1e-6,
    "actor.optim.weight_decay": 0.01,
    "actor.optim.betas": [0.9, 0.999],
    "actor.optim.lr_scheduler_type": "constant",
    "actor.policy_loss.loss_mode": "vanilla",
    "critic.optim.lr": 1e-5,
    "critic.cliprange_value": 0.5,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "rollout.top_k": -1,
    "rollout.do_sample": True,
    "rollout.gpu_memory_utilization": 0.5,
    "rollout.max_num_seqs": 1024,
    "rollout.max_num_batched_tokens": 8192,
    "rollout.val_kwargs.temperature": 0.0,
    "rollout.val_kwargs.do_sample": False,
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
    "trainer.resume_mode": "auto",
    "trainer.val_before_train": True,
    "trainer.critic_warmup": 0,
    "trainer.nnodes": 1,
}


@pytest.mark.parametrize("path", sorted(VERL_DEFAULTS))
def test_verl_defaults(path: str) -> None:
    assert schema_index()[0][path].default == VERL_DEFAULTS[path]


def test_our_default_estimator_is_grpo_with_groups() -> None:
    cfg = Config()
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.rollout.n > 1  # a GRPO group of one has no baseline


def test_defaults_are_independent_instances() -> None:
    a, b = Config(), Config()
    a.actor.optim.betas.append(0.5)
    a.model.override_config["x"] = 1
    assert b.actor.optim.betas == [0.9, 0.999]
    assert b.model.override_config == {}
    assert a.actor.optim is not a.critic.optim


def test_option_copies_mutable_defaults() -> None:
    @dataclasses.dataclass
    class Probe:
        xs: list[int] = option([1, 2], "Some numbers.")  # noqa: RUF009

    first, second = Probe(), Probe()
    first.xs.append(3)
    assert second.xs == [1, 2]
    assert dataclasses.fields(Probe)[0].metadata["help"] == "Some numbers."


def test_to_dict_is_plain_nested_data() -> None:
    d = Config().to_dict()
    assert list(d) == SECTIONS
    assert d["actor"]["optim"]["lr"] == 1e-6
    assert d["rollout"]["val_kwargs"]["n"] == 1
    assert isinstance(d["trainer"]["logger"], list)


def test_world_size_and_run_dir() -> None:
    cfg = Config()
    cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node = 2, 8
    assert cfg.trainer.world_size == 16
    cfg.trainer.project_name, cfg.trainer.experiment_name = "p", "e"
    assert cfg.trainer.run_dir() == "runs/p/e"
    cfg.trainer.default_local_dir = "/tmp/run"
    assert cfg.trainer.run_dir() == "/tmp/run"


def test_derived_critic_and_reference() -> None:
    cfg = Config()
    assert not cfg.use_critic and not cfg.use_reference
    cfg.algorithm.adv_estimator = "gae"
    assert cfg.use_critic
    cfg.critic.enable = False
    assert not cfg.use_critic
    cfg.actor.use_kl_loss = True
    assert cfg.use_reference
    cfg.actor.use_kl_loss, cfg.algorithm.use_kl_in_reward = False, True
    assert cfg.use_reference
    cfg.ref.enable = False
    assert not cfg.use_reference
