"""A mixture of experts generates tensor-parallel through the trainer: GRPO on four gloo ranks, training with
expert parallelism (``actor.parallel.ep=2`` x dp_rep=2) and the rollout in groups of two ranks
(``rollout.tensor_model_parallel_size=2``), each rank generating with its slice of every expert (Qwen2-MoE)
or with half of the experts whole (Mixtral, ``rollout.expert_parallel_size=2``: expert parallelism in
generation), filled by the reshard plan from the expert-parallel shards, the router whole, with router
replay r3 on top.

One step on chat prompts of very different lengths: every rank exits 0, the first on-policy step has
ppo_kl == 0, the rollout's log-probs equal the trainer's recomputation in float32 (the partial sums of the
sliced experts all-reduced as a dense MLP's down projection), the router agrees with the rollout's recorded
experts, and the switch line names the tensor-parallel shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.dist_util import run_world_kept
from support.realistic import realistic_rows, write_jsonl
from test_model_families import REWARD_SOURCE, check_step, overrides, train_rank

from hybridflow.models import build_tiny_model_and_tokenizer

FAMILIES = ("qwen2_moe", "mixtral")  # a shared expert (and its gate) beside the experts; experts alone
BUILT = (*FAMILIES, "qwen3_moe")
FOUR = [
    "trainer.n_gpus_per_node=4",
    "actor.parallel.ep=2",
    "rollout.tensor_model_parallel_size=2",
    "actor.router_replay=r3",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "rollout.log_prob_micro_batch_size_per_gpu=2",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny model (hidden 32, one layer, 4 experts, 2 per token), the prompts, the reward."""
    root = tmp_path_factory.mktemp("moe_tp")
    out = {
        "train": write_jsonl(realistic_rows(8, seed=3), root / "train.jsonl"),
        "reward": root / "reward.py",
    }
    out["reward"].write_text(REWARD_SOURCE)
    for name in BUILT:
        build_tiny_model_and_tokenizer(out_dir=root / name, arch=name, hidden_size=32, num_hidden_layers=1)
        out[name] = root / name
    return out


def test_grpo_with_expert_parallel_training_and_a_tensor_parallel_moe_rollout(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    ep_generate = {"qwen2_moe": [], "mixtral": ["rollout.expert_parallel_size=2"]}
    runs = [
        ["train", *overrides(setup, name, tmp_path / name, *FOUR, *ep_generate[name])] for name in FAMILIES
    ]
    ranks = run_world_kept(4, train_rank, runs, timeout=600)
    for i, name in enumerate(FAMILIES):
        assert [r[i]["code"] for r in ranks] == [0, 0, 0, 0], (name, [r[i]["messages"][-3:] for r in ranks])
        (metrics,) = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").open()]
        check_step(metrics)  # ppo_kl == 0, rollout log-probs within 1e-5 of the trainer's
        assert 0.9 < metrics["moe/router_agreement"] <= 1.0, name
        infos = [m for _, m in ranks[0][i]["messages"]]
        generate = "generate_view=(tp=2, ep=2, dp=2)" if ep_generate[name] else "generate_view=(tp=2, dp=2)"
        assert any("train_view=(fsdp=4, ep=2)" in m and generate in m for m in infos), (name, infos[:3])
        (switch,) = [m for m in infos if m.startswith("Stage switch")]
        assert "received per rank into a 1/2 tensor-parallel shard" in switch, (name, switch)
        assert ("experts split whole, 2 ways" in switch) == bool(ep_generate[name]), (name, switch)


def test_grpo_with_experts_split_across_rollout_groups(setup: dict[str, Path], tmp_path: Path) -> None:
    # rollout.expert_parallel_size=4 over 4 ranks: Qwen3-MoE with a whole replica per rank (tp=1), Mixtral in
    # two groups of two (tp=2); each rank holds one of the 4 experts whole and the groups' tokens meet at
    # every MoE layer. Two steps of 8 prompts of different lengths (2 or 4 per rollout group), router replay r3.
    views = {"qwen3_moe": "1", "mixtral": "2"}
    runs = [
        [
            "train",
            *overrides(setup, name, tmp_path / name, *FOUR),
            f"rollout.tensor_model_parallel_size={tp}",
            "rollout.expert_parallel_size=4",
            "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=8",
            "trainer.total_training_steps=2",
        ]
        for name, tp in views.items()
    ]
    ranks = run_world_kept(4, train_rank, runs, timeout=600)
    for i, (name, tp) in enumerate(views.items()):
        assert [r[i]["code"] for r in ranks] == [0, 0, 0, 0], (name, [r[i]["messages"][-3:] for r in ranks])
        steps = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").open()]
        assert len(steps) == 2, name
        check_step(steps[0])  # ppo_kl == 0, rollout log-probs within 1e-5 of the trainer's
        assert steps[1]["rollout_corr/log_prob_abs_diff_max"] <= 1e-5, name  # after an update too
        assert all(0.9 < m["moe/router_agreement"] <= 1.0 + 1e-6 for m in steps), name  # a mean of ones
        infos = [m for _, m in ranks[0][i]["messages"]]
        generate = f"generate_view=(tp={tp}, ep=4, dp={4 // int(tp)})"
        assert any("train_view=(fsdp=4, ep=2)" in m and generate in m for m in infos), (name, infos[:3])
        switch = next(m for m in infos if m.startswith("Stage switch"))
        assert "experts split whole, 4 ways" in switch, (name, switch)
