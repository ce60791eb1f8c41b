"""Loading: YAML files, dotted overrides with YAML scalar rules, round trips through save_config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hybridflow.config import (
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    parse_overrides,
    parse_value,
    save_config,
)


def _write(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8", 8),
        ("-3", -3),
        ("0.5", 0.5),
        ("1e-6", 1e-6),
        ("1E5", 1e5),
        ("-2.5e-3", -2.5e-3),
        ("2.0e3", 2000.0),
        (".5e2", 50.0),
        ("e5", "e5"),
        ("true", True),
        ("False", False),
        ("null", None),
        ("", None),
        ("[a,b]", ["a", "b"]),
        ("[1, 2.5]", [1, 2.5]),
        ("{k: 1}", {"k": 1}),
        ("'007'", "007"),
        ("vllm", "vllm"),
        ("/data/train.parquet", "/data/train.parquet"),
    ],
)
def test_parse_value_follows_yaml_scalars(text: str, expected: object) -> None:
    value = parse_value(text)
    assert value == expected and type(value) is type(expected)


def test_parse_overrides_accepts_hydra_prefixes() -> None:
    assert parse_overrides(["rollout.n=8", "+trainer.seed=3", "++model.path=/m=x"]) == [
        ("rollout.n", 8),
        ("trainer.seed", 3),
        ("model.path", "/m=x"),
    ]


@pytest.mark.parametrize("bad", ["rollout.n", "=3", "~rollout.n"])
def test_malformed_override(bad: str) -> None:
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides([bad])


def test_defaults_without_file_or_overrides() -> None:
    assert load_config() == Config()


def test_load_nested_yaml(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "# a comment\n"
        "rollout:\n  n: 4\n  temperature: 0.7\n"
        "actor:\n  optim:\n    lr: 2e-6\n    betas: [0.8, 0.9]\n"
        "trainer:\n  logger: [console, jsonl]\n  experiment_name: 123\n"
        "model.override_config:\n  rope_theta: 5000\n",
    )
    cfg = load_config(path)
    assert cfg.rollout.n == 4 and cfg.rollout.temperature == 0.7
    assert cfg.actor.optim.lr == 2e-6 and cfg.actor.optim.betas == [0.8, 0.9]
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.trainer.experiment_name == "123"  # a number given to a string field becomes a string
    assert cfg.model.override_config == {"rope_theta": 5000}
    assert cfg.critic.optim.lr == 1e-5  # untouched keys keep their defaults


def test_dotted_keys_in_yaml(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "actor.optim.lr: 3.0e-6\nrollout.n: 2\n"))
    assert cfg.actor.optim.lr == 3e-6 and cfg.rollout.n == 2


def test_empty_file_and_empty_section(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "")) == Config()
    assert load_config(_write(tmp_path, "trainer:\n# seed: 3\n", "b.yaml")) == Config()


def test_overrides_apply_after_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "rollout:\n  n: 4\n")
    cfg = load_config(path, ["rollout.n=2", "actor.optim.lr=1e-5", "trainer.val_before_train=false"])
    assert cfg.rollout.n == 2 and cfg.actor.optim.lr == 1e-5 and cfg.trainer.val_before_train is False


def test_override_types() -> None:
    cfg = load_config(
        overrides=[
            "trainer.logger=console",  # a scalar for a list field is a one-element list
            "rollout.stop_token_ids=[3,4]",
            "actor.clip_ratio_high=0.28",
            "actor.clip_ratio=1",  # an int for a float field
            "actor.ppo_max_token_len_per_gpu=2.0e3",  # an integral float for an int field
            "trainer.default_local_dir=/tmp/x",
            "reward.custom_function.path=null",
            "model.override_config.rope_scaling.factor=2.0",
            "model.override_config.rope_scaling.type=linear",
        ]
    )
    assert cfg.trainer.logger == ["console"]
    assert cfg.rollout.stop_token_ids == [3, 4]
    assert cfg.actor.clip_ratio_high == 0.28
    assert cfg.actor.clip_ratio == 1.0 and isinstance(cfg.actor.clip_ratio, float)
    assert cfg.actor.ppo_max_token_len_per_gpu == 2000 and isinstance(
        cfg.actor.ppo_max_token_len_per_gpu, int
    )
    assert cfg.trainer.default_local_dir == "/tmp/x"
    assert cfg.reward.custom_function.path is None
    assert cfg.model.override_config == {"rope_scaling": {"factor": 2.0, "type": "linear"}}


def test_last_override_wins() -> None:
    assert load_config(overrides=["rollout.n=2", "rollout.n=4"]).rollout.n == 4


def test_config_from_dict_matches_load_config(tmp_path: Path) -> None:
    data = {"rollout": {"n": 4}, "algorithm": {"adv_estimator": "rloo"}}
    path = _write(tmp_path, yaml.safe_dump(data))
    assert config_from_dict(data) == load_config(path)
    assert config_from_dict(data, ["rollout.n=2"]).rollout.n == 2


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        overrides=[
            "actor.optim.lr=3e-7",
            "rollout.n=4",
            "trainer.logger=[console,tensorboard]",
            "model.override_config.rope_theta=1e4",
            "data.train_files=[a.parquet,b.parquet]",
            "critic.enable=true",
            "trainer.experiment_name='007'",
            "algorithm.rollout_correction.rollout_is=token",
        ]
    )
    out = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert out.is_file()
    assert load_config(str(out)) == cfg
    assert yaml.safe_load(out.read_text())["actor"]["optim"]["lr"] == 3e-7


def test_missing_file() -> None:
    with pytest.raises(FileNotFoundError, match=r"no_such\.yaml"):
        load_config("no_such.yaml")


def test_invalid_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "rollout:\n  n: 4\n  top_p: [1,\n")
    with pytest.raises(ConfigError, match=r"run\.yaml: is not valid YAML \(line 4"):
        load_config(path)


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))


def test_deferred_fields_are_left_to_whoever_chooses_them() -> None:
    """``defer``: a field's problem waits (the automatic layout chooses it); every other field's is raised."""
    from hybridflow.config import ConfigError, load_config, validate_config

    five = ["rollout.n=5", "trainer.n_gpus_per_node=8"]  # 10 samples per GPU: the default micro-batch 8 fails
    with pytest.raises(ConfigError, match=r"actor\.ppo_micro_batch_size_per_gpu: 8 does not divide"):
        load_config(None, five)
    cfg = load_config(None, five, defer={"actor.ppo_micro_batch_size_per_gpu"})
    assert [p.path for p in validate_config(cfg)] == ["actor.ppo_micro_batch_size_per_gpu"]  # still there
    with pytest.raises(ConfigError, match=r"rollout\.n"):  # only the deferred field waits
        load_config(None, [*five, "rollout.n=0"], defer={"actor.ppo_micro_batch_size_per_gpu"})
