"""``model.lora_*``: verl's keys, the ranges, and each setting LoRA does not run with yet refused by its key."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config
from hybridflow.config.errors import ConfigError


def test_verls_lora_keys_are_aliases() -> None:
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.lora_rank=64",
            "actor_rollout_ref.model.lora_alpha=32",
            "actor_rollout_ref.model.target_modules=all-linear",
        ],
    )
    m = cfg.model
    assert (m.lora_rank, m.lora_alpha, m.target_modules, m.lora_dropout) == (64, 32.0, ["all-linear"], 0.0)
    assert load_config(None, ["model.target_modules=[q_proj,v_proj]"]).model.target_modules == [
        "q_proj",
        "v_proj",
    ]


@pytest.mark.parametrize(
    "overrides,key,fix",
    [
        (["model.lora_rank=-1"], "model.lora_rank", "model.lora_rank=0"),
        (["model.lora_rank=8", "model.lora_alpha=0"], "model.lora_alpha", "model.lora_alpha=16"),
        (["model.lora_rank=8", "model.lora_dropout=1"], "model.lora_dropout", "[0, 1)"),
        (["model.lora_rank=8", "model.target_modules=[]"], "model.target_modules", "all-linear"),
        (["model.lora_rank=8", "actor.hybrid_engine=false"], "actor.hybrid_engine", "hybrid_engine=true"),
        (["model.lora_rank=8", "actor.fsdp.param_offload=true"], "actor.fsdp.param_offload", "=false"),
        (["model.lora_rank=8", "ref.fsdp.param_offload=true"], "ref.fsdp.param_offload", "=false"),
        (
            ["model.lora_rank=8", "actor.fsdp.optimizer_step_on_cpu=true"],
            "actor.fsdp.optimizer_step_on_cpu",
            "=false",
        ),
        (
            ["model.lora_rank=8", "trainer.n_gpus_per_node=2", "actor.parallel.tp=2"],
            "actor.tensor_parallel_size",
            "model.lora_rank=0",
        ),
        (["critic.model.lora_rank=8"], "critic.model.lora_rank", "set it to 0"),
        (
            ["model.lora_rank=8", "rollout.lora_merge=in_place", "trainer.n_gpus_per_node=2"],
            "rollout.lora_merge",
            "rollout.lora_merge=buffer",
        ),
    ],
)
def test_lora_problems_name_the_key_and_the_fix(overrides: list[str], key: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    text = str(err.value)
    assert key in text and fix in text, text


def test_rank_zero_ignores_the_other_lora_keys() -> None:
    cfg = load_config(None, ["actor.hybrid_engine=false", "model.target_modules=[]"])
    assert cfg.model.lora_rank == 0
