"""Multi-turn rollouts through ``hybridflow train`` (``rollout.multi_turn``): the step runs its rollout as
episodes on one rank and on a tensor-parallel group of two gloo ranks, reports verl's multi-turn metrics, and
the rollout's log-probs equal the trainer's recomputation on every sampled token. A random tiny policy calls
no tool, so these runs check the wiring; the loop's tool turns are checked in tests/engine/rollout and
tests/workers (the environment renders tool turns token for token), and GRPO whose episodes call the tool
after a warm-up in tests/demos/test_tool_use_demo.py."""

from __future__ import annotations

import json
from pathlib import Path

from test_async_colocate import RUN, args, setup  # noqa: F401 (the fixture)

MULTI = [
    "rollout.multi_turn.enable=true",
    "rollout.multi_turn.format=plain",
    "rollout.multi_turn.tools=[calc,code_interpreter]",
    "trainer.total_training_steps=1",
]


def one_step(run_dir: Path) -> dict[str, float]:
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return row


def test_multi_turn_rollouts_on_one_rank_and_on_a_tensor_parallel_group(setup, tmp_path: Path) -> None:  # noqa: F811
    from support.dist_util import run_world_kept
    from test_model_families import train_rank

    from hybridflow.cli.main import main

    assert main(args(setup, tmp_path / "one", *MULTI)) == 0
    two = ["trainer.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2"]
    two += ["actor.ppo_micro_batch_size_per_gpu=4", "rollout.log_prob_micro_batch_size_per_gpu=4"]
    ranks = run_world_kept(2, train_rank, [args(setup, tmp_path / "two", *MULTI, *two)], timeout=600)
    assert [r[0]["code"] for r in ranks] == [0, 0], [r[0]["messages"][-3:] for r in ranks]
    for run in ("one", "two"):
        m = one_step(tmp_path / run)
        assert m["num_turns/mean"] >= 1 and m["num_turns/max"] <= 5
        assert m["tool_errors/mean"] >= 0 and 0 <= m["response_length/tool_fraction"] < 1
        assert m["rollout_corr/log_prob_abs_diff_max"] <= 1e-5 and m["actor/ppo_kl"] == 0.0
