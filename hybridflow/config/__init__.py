"""L1: the configuration schema, YAML loading, dotted overrides, verl aliases and validation.

    cfg = load_config("run.yaml", ["rollout.n=8", "actor.optim.lr=1e-6"])
    save_config(cfg, f"{cfg.trainer.run_dir()}/config.yaml")

See docs/config.md for every key, the verl aliases and the validation rules.
"""

from hybridflow.config.aliases import VERL_ALIASES
from hybridflow.config.choices import CHOICES, add_choice, register_choice_source
from hybridflow.config.errors import ConfigError, Problem
from hybridflow.config.loader import (
    config_from_dict,
    load_config,
    parse_overrides,
    parse_value,
    save_config,
    to_yaml,
)
from hybridflow.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    FieldSpec,
    ModelConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    schema_index,
)
from hybridflow.config.startup import check_start
from hybridflow.config.validate import check_config, get_path, validate_config

__all__ = [
    "CHOICES",
    "VERL_ALIASES",
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "FieldSpec",
    "ModelConfig",
    "Problem",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "add_choice",
    "check_config",
    "check_start",
    "config_from_dict",
    "get_path",
    "load_config",
    "parse_overrides",
    "parse_value",
    "register_choice_source",
    "save_config",
    "schema_index",
    "to_yaml",
    "validate_config",
]
