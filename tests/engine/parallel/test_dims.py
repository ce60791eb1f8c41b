"""ParallelDims: one role's view from its config section, its coordinates and groups, and parallelize()."""

from __future__ import annotations

import pytest
import torch
from support.dist_util import run_world_kept as run_world

from hybridflow.config import load_config
from hybridflow.config.schema import FSDPConfig
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.models import build_tiny_model
from hybridflow.utils.errors import UserError


def test_each_role_builds_its_view_from_its_section() -> None:
    cfg = load_config(
        overrides=[
            "trainer.n_gpus_per_node=8",
            "actor.parallel.tp=2",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",  # verl's key, the same field
            "ref.tensor_parallel_size=4",  # the flat spelling of ref.parallel.tp
            "critic.parallel.sp=2",
            "critic.model.use_remove_padding=true",
            "algorithm.adv_estimator=gae",
            "actor.use_kl_loss=true",
        ]
    )
    actor, ref, critic = (ParallelDims.of(cfg, role, 8) for role in ("actor", "ref", "critic"))
    assert (str(actor), str(ref), str(critic)) == (
        "(tp=2, pp=2, dp=2)",
        "(tp=4, pp=2, dp=1)",
        "(fsdp=8, sp=2)",
    )
    assert cfg.ref.parallel.pp is None and ref.pp == 2  # the reference's null size is the actor's
    assert critic.token_budget(100) == 200 and actor.token_budget(100) == 100
    assert critic.budgets(cfg.critic).ppo_max_token_len_per_gpu == 2 * cfg.critic.ppo_max_token_len_per_gpu


def test_ranks_are_dp_innermost_and_replicas_hold_every_stage() -> None:
    dims = ParallelDims(8, tp=2, pp=2)
    assert [dims.coords(r) for r in (0, 1, 2, 5, 7)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 1),
        (1, 1, 1),
    ]
    assert dims.replica_ranks(1) == [1, 3, 5, 7]
    assert ParallelDims(4, sp=2).replica_ranks(1) == [2, 3]  # an sp group is consecutive ranks


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        (dict(tp=3), "actor.tensor_parallel_size: 3 does not divide the 4 ranks"),
        (dict(tp=2, pp=4), "actor.pipeline_parallel_size: 4 x actor.tensor_parallel_size=2 does not divide"),
        (dict(ep=3), "actor.parallel.ep: 3 does not divide the 4 ranks"),
        (dict(ep=2, sp=2), "actor.parallel.ep: is 2 with actor.ulysses_sequence_parallel_size=2: expert"),
        (dict(pp=0), "actor.pipeline_parallel_size: must be at least 1"),
    ],
)
def test_sizes_that_do_not_fit_the_world_are_refused_naming_the_field(sizes: dict, words: str) -> None:
    with pytest.raises(UserError) as info:
        ParallelDims(4, **sizes)
    assert str(info.value).startswith(words)


def test_the_model_check_names_the_field_and_the_model_fields() -> None:
    config = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1).config
    ParallelDims(4, tp=2, pp=2, role="critic").check_model(config)  # 4 heads, 2 KV heads, 2 layers: fine
    with pytest.raises(UserError, match=r"critic\.pipeline_parallel_size=4 is more than the model's 2"):
        ParallelDims(4, pp=4, role="critic").check_model(config)
    with pytest.raises(
        UserError, match=r"ref\.tensor_parallel_size=4 does not split .*num_key_value_heads=2"
    ):
        ParallelDims(4, tp=4, role="ref").check_model(config)


def built_groups(rank: int) -> dict:
    """The ranks of each group of a tp=2 view over 4 ranks, and of an sp=2 one; a parallelized model."""
    import torch.distributed as dist

    from hybridflow.engine.parallel.parallelize import parallelize

    def ranks(group: dist.ProcessGroup | None) -> list[int] | None:
        return None if group is None else dist.get_process_group_ranks(group)

    tp = ParallelDims(4, tp=2).build()
    sp = ParallelDims(4, sp=2).build()
    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
    frozen = parallelize(lm, tp, FSDPConfig(param_dtype="bfloat16"), trainable=False, compile=False)
    q = dict(frozen.module.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    return {
        "rank": tp.rank,
        "tp": [
            ranks(tp.dp_group),
            ranks(tp.pp_group),
            tp.replica_ranks(tp.dp_rank),
            tp.tp_mesh.mesh.tolist(),
        ],
        "sp": [ranks(sp.dp_group), ranks(sp.sp_group), sp.replica_ranks(sp.dp_rank), sp.fsdp_mesh],
        "masters": sorted({str(p.dtype) for p in frozen.module.parameters()}),
        "q": (tuple(q.shape), tuple(q.to_local().shape)),
        "compute": str(frozen.compute_dtype),
    }


def test_a_built_view_holds_its_groups_and_parallelize_lays_the_model_out() -> None:
    got = run_world(4, built_groups)
    for rank, out in enumerate(got):
        assert out["rank"] == rank
        dp_group, pp_group, replica, tp_mesh = out["tp"]
        assert dp_group == [rank - rank % 2, rank - rank % 2 + 1]  # dp innermost: ranks 0,1 | 2,3
        assert (
            pp_group == [rank] and replica == [rank % 2, rank % 2 + 2] and tp_mesh == [rank % 2, rank % 2 + 2]
        )
        sp_dp, sp_group, sp_replica, fsdp_mesh = out["sp"]
        assert sp_dp == [rank % 2, rank % 2 + 2] and sp_group == sp_replica == [
            rank - rank % 2,
            rank - rank % 2 + 1,
        ]
        assert fsdp_mesh is None  # FSDP2 over every rank under Ulysses
        assert out["masters"] == [str(torch.bfloat16)] == [out["compute"]]  # frozen: masters in compute dtype
        assert out["q"] == ((32, 32), (8, 32))  # 32 rows over tp=2 (column-parallel), then FSDP2 over dp=2
