"""Several ranks on data that looks real: prompts of very different lengths, EOS at different places.

Every process runs the driver (torchrun's layout, here spawned with gloo). The ranks pad their shares to their
own longest prompt, so each merge of rank results joins shares of different widths.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_util import run_world
from realistic import REWARD_SOURCE, TOKEN_REWARD_SOURCE, build_stopping_model, realistic_rows, write_jsonl

pytestmark = pytest.mark.slow

COMMON = [
    "data.max_prompt_length=400",
    "data.max_response_length=10",
    "data.train_batch_size=4",
    "data.val_batch_size=6",  # 8 validation prompts: a full batch of 6, then 2 (padded rows on 4 ranks)
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "rollout.log_prob_micro_batch_size_per_gpu=2",
    "ref.log_prob_micro_batch_size_per_gpu=2",
    "actor.optim.lr=1e-3",
    "critic.optim.lr=1e-3",
    "trainer.total_training_steps=3",
    "trainer.test_freq=3",
    "trainer.device=cpu",
    "trainer.logger=[console]",
]
# Differ between runs of the same computation: clocks, throughput, token-balance statistics.
VOLATILE = ("timing_s/", "perf/", "global_seqlen/", "memory/")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multi_rank")
    (root / "reward.py").write_text(REWARD_SOURCE)
    (root / "token_reward.py").write_text(TOKEN_REWARD_SOURCE)
    (root / "empty.yaml").write_text("{}\n")
    return {
        "model": build_stopping_model(root / "model"),
        "train": write_jsonl(realistic_rows(16, seed=0), root / "train.jsonl"),
        "val": write_jsonl(realistic_rows(8, seed=1), root / "val.jsonl"),
        "reward": root / "reward.py",
        "token_reward": root / "token_reward.py",
        "config": root / "empty.yaml",
    }


def argv(setup: dict[str, Path], run_dir: Path, world: int, *extra: str) -> list[str]:
    return [
        "train",
        str(setup["config"]),
        f"model.path={setup['model']}",
        f"data.train_files=[{setup['train']}]",
        f"data.val_files=[{setup['val']}]",
        f"reward.custom_function.path={setup['reward']}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.n_gpus_per_node={world}",
        *COMMON,
        *extra,
    ]


def spmd_rank(rank: int, args: list[str]) -> int:
    """One process of a torchrun-style run."""
    from hybridflow.cli.main import main

    return main(args)


def run(setup: dict[str, Path], run_dir: Path, world: int, *extra: str) -> dict[int, dict[str, float]]:
    """Train on ``world`` ranks; the metrics of each step (the volatile ones left out)."""
    assert run_world(world, spmd_rank, argv(setup, run_dir, world, *extra), timeout=600) == [0] * world
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def check_rollout_matches_trainer(metrics: dict[int, dict[str, float]]) -> None:
    """Rollout log-probs equal the trainer's recomputation (float32), every step."""
    for step, m in metrics.items():
        if "rollout_corr/log_prob_abs_diff_max" in m:
            assert m["rollout_corr/log_prob_abs_diff_max"] <= 1e-5, (step, m)


def test_the_fixture_looks_like_real_data(setup: dict[str, Path]) -> None:
    from hybridflow.data import RLDataset, load_rows
    from hybridflow.models import load_tokenizer

    tok = load_tokenizer(str(setup["model"]))
    ds = RLDataset(load_rows([str(setup["train"])]), tok, max_prompt_length=400)
    lengths = sorted(len(ds[i]["input_ids"]) for i in range(len(ds)))
    assert lengths[0] < 15 and lengths[-1] > 250 and len(set(lengths)) > 10
    assert {ds[i]["data_source"] for i in range(len(ds))} == {"chat/tie", "chat/vary"}


def test_ppo_with_a_critic_on_two_ranks_equals_one_rank(tmp_path: Path, setup: dict[str, Path]) -> None:
    """Greedy rollouts make the two runs see the same samples: every loss, norm and score must agree."""
    extra = (
        "algorithm.adv_estimator=gae",
        "rollout.do_sample=false",
        "actor.use_kl_loss=true",  # with the reference's log-probs
        "model.use_remove_padding=true",
        "critic.model.use_remove_padding=true",
    )
    one = run(setup, tmp_path / "one", 1, *extra)
    two = run(setup, tmp_path / "two", 2, *extra)
    assert sorted(one) == sorted(two) == [0, 1, 2, 3]
    for step in one:
        assert one[step].keys() == two[step].keys(), step
        for key, value in one[step].items():
            assert two[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
    lengths = [one[s]["response_length/mean"] for s in (1, 2, 3)]
    assert any(one[s]["response_length/clip_ratio"] < 1 for s in (1, 2, 3)), lengths  # EOS before the limit
    assert "critic/vf_loss" in one[1] and "val-core/chat/vary/reward/mean@1" in one[3]
    check_rollout_matches_trainer(one)
    check_rollout_matches_trainer(two)


@pytest.mark.parametrize("world", [2, 4])
def test_grpo_on_several_ranks_with_a_token_id_reward(
    tmp_path: Path, setup: dict[str, Path], world: int
) -> None:
    metrics = run(
        setup,
        tmp_path / "run",
        world,
        f"reward.custom_function.path={setup['token_reward']}",
        "algorithm.adv_estimator=grpo",
        "trainer.balance_batch=true",
    )
    assert sorted(metrics) == [0, 1, 2, 3]
    check_rollout_matches_trainer(metrics)
    for step in (1, 2, 3):
        assert 0.0 <= metrics[step]["critic/score/mean"] <= 1.0
        assert metrics[step]["response_length/max"] > metrics[step]["response_length/min"]


def test_dynamic_sampling_joins_rounds_of_different_widths(tmp_path: Path, setup: dict[str, Path]) -> None:
    """DAPO's rounds each pad their prompts to their own longest; the kept groups must join."""
    metrics = run(
        setup,
        tmp_path / "run",
        2,
        "algorithm.adv_estimator=grpo",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=seq_reward",
        "data.gen_batch_size=4",
        "rollout.n=4",
        "actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
    )
    assert sorted(metrics) == [1, 2]
    assert all(m["train/num_gen_batches"] >= 1 for m in metrics.values())
