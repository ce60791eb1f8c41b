"""Asynchronous training on one pool (``trainer.async_mode=colocate``) through ``hybridflow train``: partial
rollouts carried across steps with bounded staleness, ``wait`` and ``drop``, the in-flight groups saved with
a checkpoint (kill -9 and resume reproduce the run, nothing trained twice), and ``sync`` unchanged."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from support.realistic import realistic_rows, write_jsonl
from test_checkpointing import VOLATILE, start_cli, wait_for

from hybridflow.cli.main import main
from hybridflow.config import load_config
from hybridflow.config.errors import ConfigError
from hybridflow.models import build_tiny_model_and_tokenizer

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 11 / 10
"""
RUN = [
    "algorithm.adv_estimator=grpo",
    "data.max_prompt_length=400",
    "data.max_response_length=24",
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor.optim.lr=1e-3",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.device=cpu",
    "trainer.logger=[console]",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Qwen2 whose stop tokens are about a tenth of its vocabulary: responses end anywhere from the
    first token to the limit, so each step has a long tail to carry over."""
    root = tmp_path_factory.mktemp("async")
    model, tokenizer = build_tiny_model_and_tokenizer(
        out_dir=root / "model", hidden_size=32, num_hidden_layers=1
    )
    model.generation_config.eos_token_id = [2, 4, *range(40, 64)]
    model.generation_config.save_pretrained(root / "model")
    # the same model stopping on a twentieth of its tokens: tails of several rounds of 16 decode steps
    model.save_pretrained(root / "long")
    tokenizer.save_pretrained(root / "long")
    model.generation_config.eos_token_id = [2, 4, *range(40, 50)]
    model.generation_config.save_pretrained(root / "long")
    (root / "reward.py").write_text(REWARD)
    return {
        "model": root / "model",
        "long": root / "long",
        "train": write_jsonl(realistic_rows(24, seed=5), root / "train.jsonl"),
        "reward": root / "reward.py",
    }


def args(setup: dict[str, Path], run_dir: Path, *extra: str, model: str = "model") -> list[str]:
    return [
        "train",
        f"model.path={setup[model]}",
        f"data.train_files=[{setup['train']}]",
        f"reward.custom_function.path={setup['reward']}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        *RUN,
        *extra,
    ]


def metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def trained(run_dir: Path) -> dict[int, list[dict]]:
    """Each step's trained samples (the rollout dumps: one record per sample, with its group's uid)."""
    out = {}
    for path in sorted((run_dir / "rollouts").glob("*.jsonl")):
        out[int(path.stem)] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def check_groups(steps: dict[int, list[dict]], batch: int = 4, n: int = 2) -> None:
    """Every step trains ``batch`` whole groups of ``n``, and no group twice."""
    seen: set[str] = set()
    for step, records in steps.items():
        uids = [r["uid"] for r in records]
        assert len(records) == batch * n and all(uids.count(u) == n for u in uids), (step, uids)
        assert not seen & set(uids), f"step {step} trains a group again: {seen & set(uids)}"
        seen |= set(uids)


def test_sync_mode_is_the_synchronous_trainer(setup: dict[str, Path], tmp_path: Path) -> None:
    default, sync = tmp_path / "default", tmp_path / "sync"
    assert main(args(setup, default, "trainer.total_training_steps=3")) == 0
    assert main(args(setup, sync, "trainer.total_training_steps=3", "trainer.async_mode=sync")) == 0
    want, got = metrics(default), metrics(sync)
    assert sorted(got) == [1, 2, 3] and got == want
    assert not any(k.startswith("async/") for k in got[1])


@pytest.mark.parametrize("policy", ["wait", "drop"])
def test_colocate_carries_the_long_tail_with_bounded_staleness(
    setup: dict[str, Path], tmp_path: Path, policy: str
) -> None:
    run = tmp_path / policy
    extra = [
        "trainer.total_training_steps=5",
        "trainer.async_mode=colocate",
        f"trainer.staleness_policy={policy}",
    ]
    extra.append("data.max_response_length=64")  # a tail longer than two rounds of 16 decode steps
    assert main(args(setup, run, *extra, model="long")) == 0
    m = metrics(run)
    assert sorted(m) == [1, 2, 3, 4, 5]
    check_groups(trained(run))
    assert all(m[s]["async/staleness_max"] <= 1 for s in m)  # trainer.max_staleness=1
    assert max(m[s]["async/staleness_max"] for s in m) == 1  # and some groups were carried
    assert max(m[s]["async/partial_fraction"] for s in m) > 0  # some samples span two versions
    assert all(m[s]["rollout_corr/rollout_is_max"] <= 2.0 for s in m)  # token-level TIS, truncated at 2
    dropped = sum(m[s]["async/dropped"] for s in m)
    assert (dropped > 0) if policy == "drop" else (dropped == 0)
    assert m[1]["actor/ppo_kl"] == 0.0  # the first update is on the proximal policy itself
    # step 1's tokens all come from the weights the proximal pass recomputes: the rollout's log-probs are the
    # trainer's (float32); later steps mix versions, so only the first is exact
    assert m[1]["rollout_corr/log_prob_abs_diff_max"] <= 1e-5


def test_kill_and_resume_continues_the_groups_in_flight(setup: dict[str, Path], tmp_path: Path) -> None:
    extra = ["trainer.total_training_steps=5", "trainer.async_mode=colocate", "trainer.save_freq=2"]
    straight = tmp_path / "straight"
    assert main(args(setup, straight, *extra)) == 0
    resumed = tmp_path / "resumed"
    proc = start_cli(args(setup, resumed, *extra), tmp_path / "first.log")
    wait_for(resumed / "global_step_2" / "meta.json", proc, tmp_path / "first.log")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = torch.load(resumed / "global_step_2" / "trainer_state.pt", weights_only=False)
    assert len(state["in_flight"]["flights"]) == 4  # the groups in flight were saved with the step
    assert main(args(setup, resumed, *extra)) == 0
    want, got = metrics(straight), metrics(resumed)
    for step in (3, 4, 5):
        assert got[step].keys() == want[step].keys()
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
    steps = trained(resumed)
    check_groups({s: steps[s] for s in sorted(steps)})  # steps 1-2 before the kill, 3-5 after: none twice


SEPARATE = ["trainer.async_mode=separate", "trainer.backend=ray"]


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["trainer.async_mode=separate"], "trainer.backend"),
        (["trainer.async_mode=separate", "trainer.backend=ray"], "trainer.rollout_pool_size"),
        (
            [
                *SEPARATE,
                "trainer.rollout_pool_size=3",
                "rollout.tensor_model_parallel_size=2",
                "trainer.n_gpus_per_node=2",
            ],
            "trainer.rollout_pool_size",
        ),
        (
            [*SEPARATE, "trainer.rollout_pool_size=1", "trainer.staleness_policy=drop"],
            "trainer.staleness_policy",
        ),
        (["trainer.rollout_pool_size=2"], "trainer.rollout_pool_size"),
        (["trainer.async_mode=separate", "algorithm.adv_estimator=remax"], "algorithm.adv_estimator"),
        (["trainer.async_mode=colocate", "algorithm.adv_estimator=remax"], "algorithm.adv_estimator"),
        (["trainer.async_mode=colocate", "algorithm.filter_groups.enable=true"], "algorithm.filter_groups"),
        (["trainer.async_mode=colocate", "rollout.engine=hf"], "rollout.engine"),
        (["trainer.max_staleness=0"], "trainer.max_staleness"),
        (["trainer.staleness_policy=keep"], "trainer.staleness_policy"),
    ],
)
def test_what_the_async_modes_do_not_take_is_refused_naming_the_key(extra: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, extra)


def test_colocate_on_two_ranks_splits_the_groups_and_the_quota_over_rollout_groups(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    from support.dist_util import run_world_kept
    from test_model_families import train_rank

    runs = []
    for tp in (1, 2):  # two rollout groups of one rank, or one tensor-parallel group of two
        extra = ["trainer.total_training_steps=3", "trainer.async_mode=colocate", "trainer.n_gpus_per_node=2"]
        extra += [f"rollout.tensor_model_parallel_size={tp}", "data.max_response_length=64"]
        extra += ["actor.ppo_micro_batch_size_per_gpu=4", "rollout.log_prob_micro_batch_size_per_gpu=4"]
        runs.append(args(setup, tmp_path / f"tp{tp}", *extra, model="long"))
    ranks = run_world_kept(2, train_rank, runs, timeout=600)
    for i, tp in enumerate((1, 2)):
        assert [r[i]["code"] for r in ranks] == [0, 0], [r[i]["messages"][-3:] for r in ranks]
        m = metrics(tmp_path / f"tp{tp}")
        check_groups(trained(tmp_path / f"tp{tp}"))
        assert all(m[s]["async/staleness_max"] <= 1 for s in m) and max(
            m[s]["async/staleness_max"] for s in m
        )
