"""The first line of a run: the world size and every role's rank layout, from the config."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config
from hybridflow.engine.hybrid.world import world_line


@pytest.mark.parametrize(
    "overrides,line",
    [
        (
            ["trainer.device=cpu"],
            "world: 1 rank (1 node x 1, cpu/gloo, local backend); actor train_view=(fsdp=1) "
            "generate_view=(tp=1, dp=1) (hybrid engine)",
        ),
        (
            [
                "trainer.device=cpu",
                "trainer.n_gpus_per_node=4",
                "trainer.backend=ray",
                "rollout.tensor_model_parallel_size=2",
                "algorithm.adv_estimator=gae",
                "actor.use_kl_loss=true",
            ],
            "world: 4 ranks (1 node x 4, cpu/gloo, ray backend); actor train_view=(fsdp=4) "
            "generate_view=(tp=2, dp=2) (hybrid engine); reference train_view=(fsdp=4); "
            "critic train_view=(fsdp=4)",
        ),
        (
            [
                "trainer.device=cpu",
                "trainer.nnodes=2",
                "trainer.n_gpus_per_node=4",
                "trainer.backend=ray",
                "actor.tensor_parallel_size=2",
                "actor.pipeline_parallel_size=2",
                "actor.hybrid_engine=false",
                "algorithm.adv_estimator=gae",
                "trainer.placement=split",
            ],
            "world: 8 ranks (2 nodes x 4, cpu/gloo, ray backend); actor train_view=(tp=2, pp=2, dp=2) "
            "generate_view=(tp=1, dp=8) (baseline: a kept copy per rank); critic train_view=(fsdp=8) "
            "on 8 ranks of its own",
        ),
        (  # the HybridFlow write-ups' mixture-of-experts mapping: train tp=8, ep=2 -> generate tp=4
            [
                "trainer.device=cpu",
                "trainer.nnodes=2",
                "trainer.n_gpus_per_node=8",
                "actor.parallel.tp=8",
                "megatron.expert_model_parallel_size=2",
                "rollout.tensor_model_parallel_size=4",
                "actor_rollout_ref.rollout.expert_parallel_size=4",
            ],
            "world: 16 ranks (2 nodes x 8, cpu/gloo, local backend); actor train_view=(tp=8, pp=1, dp=2, ep=2) "
            "generate_view=(tp=4, ep=4, dp=4) (hybrid engine)",
        ),
    ],
)
def test_the_world_line_names_every_view(overrides: list[str], line: str) -> None:
    assert world_line(load_config(None, overrides)) == line


def test_ulysses_groups_show_in_the_training_view() -> None:
    cfg = load_config(
        None,
        [
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=2",
            "actor.ulysses_sequence_parallel_size=2",
            "model.use_remove_padding=true",
        ],
    )
    assert "actor train_view=(fsdp=2, sp=2)" in world_line(cfg)
