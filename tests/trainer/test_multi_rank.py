"""Several ranks on data that looks real: prompts of very different lengths, EOS at different places.

Every process runs the driver (torchrun's layout, here spawned with gloo). The ranks pad their shares to their
own longest prompt, so each merge of rank results joins shares of different widths.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.dist_util import run_world_kept as run_world
from support.realistic import (
    REWARD_SOURCE,
    STOP_CHARS,
    TOKEN_REWARD_SOURCE,
    build_chatty_model,
    build_stopping_model,
    realistic_rows,
    sft_rows,
    write_jsonl,
)
from support.sft_util import LORA, assert_same_sft, sft_argv, step_metrics, trained_weights

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
        "chatty": build_chatty_model(root / "chatty"),
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


def spmd_rank(rank: int, *runs: list[str]) -> list[int]:
    """One process of torchrun-style runs, one after another (a process start costs more than a tiny run)."""
    from hybridflow.cli.main import main

    return [main(args) for args in runs]


def metrics_of(run_dir: Path) -> dict[int, dict[str, float]]:
    """The metrics of each step of a run (the volatile ones left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def run(setup: dict[str, Path], run_dir: Path, world: int, *extra: str) -> dict[int, dict[str, float]]:
    """Train on ``world`` ranks; the metrics of each step."""
    assert run_world(world, spmd_rank, argv(setup, run_dir, world, *extra), timeout=600) == [[0]] * world
    return metrics_of(run_dir)


def steady(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics of the computation: not clocks, not the rollout's statistics (rank 0's share), not the
    switch's bytes (which depend on the layout)."""
    return {k: v for k, v in metrics.items() if not k.startswith((*VOLATILE, "rollout/", "reshard/"))}


A = "actor_rollout_ref"


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
    assert (
        lengths[0] < 30 and lengths[-1] > 250
    )  # the text prompts: a few tokens in the chat template and len(set(lengths)) > 10
    assert {ds[i]["data_source"] for i in range(len(ds))} == {"chat/tie", "chat/vary"}


class Replay:
    """A rollout engine that returns responses recorded from the real one, looked up by prompt tokens.

    Replaying one recording on 1 and on 2 ranks gives both the same samples (sampling seeds differ by rank),
    while each rank still lays out its own share (its own longest prompt) and the driver merges the shares.
    """

    def __init__(self, recorded: dict[tuple[int, ...], list]) -> None:
        self.recorded = recorded

    def generate(self, prompts: list[list[int]], params, progress=None) -> list[list]:
        out = [self.recorded[tuple(p)][: params.n] for p in prompts]
        if progress is not None:
            progress(sum(len(o) for o in out))
        return out


def record_rollouts(c, cfg, out: Path) -> dict[str, float]:
    """Sample every training prompt's responses (and one greedy answer per validation prompt) to ``out``."""
    import pickle

    actor = c.groups[0].worker.roles["actor"]
    recorded = {}
    for dataset, n, do_sample in ((c.train, cfg.rollout.n, True), (c.val, 1, False)):
        ids = [dataset[i]["input_ids"] for i in range(len(dataset))]
        params = actor.sampling_params(n, 1.0, 1.0, -1, do_sample, c.eos_token_ids, seed=7)
        recorded.update(
            {tuple(p): group for p, group in zip(ids, actor.hybrid.rollout.generate(ids, params))}
        )
    out.write_bytes(pickle.dumps(recorded))
    lengths = [len(s.token_ids) for g in recorded.values() for s in g]
    reasons = [s.finish_reason for g in recorded.values() for s in g]
    return {
        "min": min(lengths),
        "max": max(lengths),
        "eos": reasons.count("eos"),
        "length": reasons.count("length"),
    }


def replayed_run(rank: int, overrides: list[str], recording: str) -> tuple[list[dict[str, float]], dict]:
    """PPO on recorded samples (recorded here first when the file does not exist yet); the step metrics."""
    import pickle

    from hybridflow.config import load_config
    from hybridflow.trainer.builder import build_components
    from hybridflow.trainer.ppo import PPOTrainer

    cfg = load_config(None, overrides)
    c = build_components(cfg)
    made = {} if Path(recording).exists() else record_rollouts(c, cfg, Path(recording))
    c.groups[0].worker.roles["actor"].hybrid.rollout = Replay(pickle.loads(Path(recording).read_bytes()))
    history = PPOTrainer(cfg, c).fit()
    c.close()
    return history, made


def test_ppo_with_a_critic_on_two_ranks_equals_one_rank_on_the_same_samples(
    tmp_path: Path, setup: dict[str, Path]
) -> None:
    def overrides(world: int, name: str) -> list[str]:
        return argv(setup, tmp_path / name, world, *ppo)[2:]  # without the command and the YAML file

    ppo = (
        "algorithm.adv_estimator=gae",
        "actor.use_kl_loss=true",  # with the reference's log-probs
        "model.use_remove_padding=true",
        "critic.model.use_remove_padding=true",
    )
    recording = str(tmp_path / "rollouts.pkl")
    ((one, made),) = run_world(1, replayed_run, overrides(1, "one"), recording, timeout=600)
    assert made["eos"] > 0 and made["length"] > 0 and made["min"] < made["max"]  # EOS at different places
    two = [history for history, _ in run_world(2, replayed_run, overrides(2, "two"), recording, timeout=600)]
    assert [steady(m) for m in two[0]] == [steady(m) for m in two[1]]  # every rank runs the driver
    one, two = [steady(m) for m in one], [steady(m) for m in two[0]]
    assert len(one) == len(two) == 3
    for step, (want, got) in enumerate(zip(one, two), start=1):
        assert want.keys() == got.keys(), step
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
    # the recorded log-probs are the initial policy's: the trainer's recomputation matches at step 1
    assert one[0]["rollout_corr/log_prob_abs_diff_max"] <= 1e-5
    assert two[0]["rollout_corr/log_prob_abs_diff_max"] <= 1e-5
    assert "critic/vf_loss" in one[0] and "val-core/chat/vary/reward/mean@1" in one[-1]


@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 2)])
def test_grpo_on_several_ranks_with_a_token_id_reward(
    tmp_path: Path, setup: dict[str, Path], world: int, tp: int
) -> None:
    """At 4 ranks, verl's Megatron keys: the actor and the reference train at tp=2 x pp=2 (two pipeline
    stages of two tensor-parallel ranks) and rollout groups of 2 tensor-parallel ranks generate (dp=2),
    resharded from the stages' tensor-parallel training shards."""
    views = (
        []
        if tp == 1
        else [
            f"{A}.actor.strategy=megatron",
            f"{A}.actor.megatron.tensor_model_parallel_size={tp}",
            f"{A}.actor.megatron.pipeline_model_parallel_size=2",
            "actor.use_kl_loss=true",  # a reference, in the actor's view (ref.*=null)
            f"{A}.actor.use_dynamic_bsz=true",  # micro-batches by tokens, padded to one shape per pass
            f"{A}.actor.ppo_max_token_len_per_gpu=512",
        ]
    )
    metrics = run(
        setup,
        tmp_path / "run",
        world,
        f"reward.custom_function.path={setup['token_reward']}",
        "algorithm.adv_estimator=grpo",
        "trainer.balance_batch=true",
        f"rollout.tensor_model_parallel_size={tp}",
        *views,
    )
    assert sorted(metrics) == [0, 1, 2, 3]
    check_rollout_matches_trainer(metrics)
    assert metrics[1]["actor/ppo_kl"] == 0.0  # on-policy: the update's first ratio is exactly 1
    for step in (1, 2, 3):
        assert 0.0 <= metrics[step]["critic/score/mean"] <= 1.0
        assert metrics[step]["response_length/max"] > metrics[step]["response_length/min"]
        received = [metrics[step][f"reshard/rank{r}_received_mib"] for r in range(world)]
        assert all(0 < mib < 1 for mib in received), received  # a part of a copy (tiny model: < 1 MiB)


def test_grpo_with_sequence_parallelism_on_two_ranks(tmp_path: Path, setup: dict[str, Path]) -> None:
    """Ulysses sp=2 (verl's keys): the two ranks are one data-parallel group whose actor and reference split
    each packed micro-batch, with token budgets and gradient checkpointing; rollout groups of 2
    tensor-parallel ranks generate."""
    metrics = run(
        setup,
        tmp_path / "run",
        2,
        f"reward.custom_function.path={setup['token_reward']}",
        "algorithm.adv_estimator=grpo",
        f"{A}.actor.ulysses_sequence_parallel_size=2",
        "model.use_remove_padding=true",
        "model.enable_gradient_checkpointing=true",
        "actor.use_kl_loss=true",
        "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=512",
        "rollout.log_prob_use_dynamic_bsz=true",
        "rollout.log_prob_max_token_len_per_gpu=512",
        "rollout.tensor_model_parallel_size=2",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
    )
    assert sorted(metrics) == [0, 1, 2]
    check_rollout_matches_trainer(metrics)
    assert metrics[1]["actor/ppo_kl"] == 0.0 and metrics[1]["actor/grad_norm"] > 0
    assert all(0.0 <= metrics[step]["critic/score/mean"] <= 1.0 for step in (1, 2))


def test_remax_with_a_reward_model_on_two_ranks(tmp_path: Path, setup: dict[str, Path]) -> None:
    """The greedy baseline generates again from the batch's prompts; a reward model scores both."""
    from support.reward_model_util import save_reward_model

    from hybridflow.models import load_tokenizer

    save_reward_model(tmp_path / "rm", len(load_tokenizer(str(setup["model"]))))
    metrics = run(
        setup,
        tmp_path / "run",
        2,
        "algorithm.adv_estimator=remax",
        "reward.model.enable=true",
        f"reward.model.path={tmp_path / 'rm'}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
    )
    assert sorted(metrics) == [0, 1, 2]
    check_rollout_matches_trainer(metrics)
    assert metrics[1]["critic/score/max"] > metrics[1]["critic/score/min"]  # the reward model scores


@pytest.mark.parametrize(
    ("world", "variant"), [(4, "rollout.tensor_model_parallel_size=2"), (2, "actor.hybrid_engine=false")]
)
def test_greedy_runs_equal_the_replica_layout(
    tmp_path: Path, setup: dict[str, Path], world: int, variant: str
) -> None:
    """The tensor-parallel view (and the baseline's broadcast copy) generate what whole replicas generate."""
    from hybridflow.models import load_tokenizer

    stops = load_tokenizer(str(setup["chatty"])).convert_tokens_to_ids(list(STOP_CHARS))
    greedy = (
        f"model.path={setup['chatty']}",
        f"rollout.stop_token_ids=[{','.join(map(str, stops))}]",
        "rollout.do_sample=false",
        "rollout.n=1",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        "algorithm.adv_estimator=reinforce_plus_plus",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
    )
    runs = [
        argv(setup, tmp_path / "replicas", world, *greedy),
        argv(setup, tmp_path / "variant", world, *greedy, variant),
    ]
    assert run_world(world, spmd_rank, *runs, timeout=600) == [[0, 0]] * world
    want, got = metrics_of(tmp_path / "replicas"), metrics_of(tmp_path / "variant")
    assert sorted(want) == sorted(got) == [0, 1, 2]
    for step in want:  # the rollout's statistics are rank 0's: a rollout group counts its whole share
        theirs, mine = steady(want[step]), steady(got[step])
        assert mine.keys() == theirs.keys(), step
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
    assert want[1]["actor/grad_norm"] > 0 and want[1]["response_length/max"] > want[1]["response_length/min"]


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
    assert max(m["train/num_gen_batches"] for m in metrics.values()) >= 2  # rounds were joined


PREFERENCE = [
    "data.max_prompt_length=400",
    "data.max_response_length=24",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "ref.log_prob_micro_batch_size_per_gpu=2",
    "actor.optim.lr=1e-3",
    "trainer.total_training_steps=2",
    "trainer.device=cpu",
    "trainer.logger=[console]",
]


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_preference_training_on_two_ranks_equals_one_rank(
    tmp_path: Path, setup: dict[str, Path], kind: str
) -> None:
    from support.realistic import kto_rows, preference_rows

    rows = preference_rows(8) if kind == "dpo" else kto_rows(8)
    data = write_jsonl(rows, tmp_path / f"{kind}.jsonl")

    def train(world: int) -> dict[int, dict[str, float]]:
        run_dir = tmp_path / f"run{world}"
        args = [kind, str(setup["config"]), f"model.path={setup['model']}", f"data.train_files=[{data}]"]
        args += [f"trainer.default_local_dir={run_dir}", f"trainer.n_gpus_per_node={world}", *PREFERENCE]
        assert run_world(world, spmd_rank, args, timeout=600) == [[0]] * world
        return {step: steady(m) for step, m in metrics_of(run_dir).items()}

    one, two = train(1), train(2)
    assert sorted(one) == sorted(two) == [1, 2]
    for step in one:
        assert one[step].keys() == two[step].keys()
        for key, value in one[step].items():
            assert two[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
    assert one[2]["loss"] != one[1]["loss"]  # the first step trained the policy


# The actor's training views on two ranks: FSDP2 over both, Ulysses, tensor parallelism, LoRA on FSDP2.
SFT_VIEWS = {
    "fsdp": (),
    "sp": ("actor.parallel.sp=2", "model.use_remove_padding=true"),
    "tp": ("actor.parallel.tp=2",),
    "lora": LORA,
}


def test_sft_on_two_ranks_equals_one_rank(tmp_path: Path, setup: dict[str, Path]) -> None:
    """``hybridflow sft`` on two torchrun-style ranks, in each training view of the actor, gives one rank's
    losses and trained weights (1e-5) on rows of very different lengths and masked tool conversations."""
    data = write_jsonl(sft_rows(8), tmp_path / "sft.jsonl")
    model = setup["model"]
    one = [sft_argv(model, data, tmp_path / "one"), sft_argv(model, data, tmp_path / "one-lora", 1, *LORA)]
    assert run_world(1, spmd_rank, *one, timeout=600) == [[0, 0]]
    two = [sft_argv(model, data, tmp_path / name, 2, *extra) for name, extra in SFT_VIEWS.items()]
    assert run_world(2, spmd_rank, *two, timeout=600) == [[0] * len(two)] * 2
    for name in SFT_VIEWS:
        assert_same_sft(tmp_path / ("one-lora" if name == "lora" else "one"), tmp_path / name)
    base, trained = load_file(model / "model.safetensors"), trained_weights(tmp_path / "one")
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # the steps moved the weights
    losses = [m["sft/loss"] for m in step_metrics(tmp_path / "one").values()]
    assert losses[1] != losses[0]


def test_exact_mode_on_two_ranks_logs_no_mismatch(tmp_path: Path, setup: dict[str, Path]) -> None:
    """``rollout.exact`` at dp=2: each rank generates on a replica resharded from the FSDP2 shards, and its
    log-probs are still bitwise the trainer's (``tests/trainer/test_exact_mode.py`` runs one rank)."""
    metrics = run(
        setup, tmp_path / "run", 2, "algorithm.adv_estimator=grpo", "rollout.exact=true",
        "trainer.total_training_steps=2", "trainer.test_freq=-1",
    )  # fmt: skip
    for step in (1, 2):
        assert metrics[step]["rollout_corr/log_prob_abs_diff_max"] == 0.0
        assert metrics[step]["actor/ppo_kl"] == 0.0
