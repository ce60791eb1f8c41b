"""The switch line: every train -> generate switch says what moved, from the reshard plan; INFO on the run's
first switch and whenever the figure changes, DEBUG otherwise (the console stays readable)."""

from __future__ import annotations

import logging
import os

import pytest
from support.batches import prompt_batch
from support.dist_util import run_world_kept

from hybridflow.protocol import Batch


def prompts(rank: int) -> Batch:
    """Four left-padded prompts of 3-9 tokens (a different share on each rank)."""
    return prompt_batch([9, 3, 6, 4], seed=rank)


def switch_lines(rank: int, arch: str, overrides: list[str]) -> dict:
    """The switch lines (level, text) of two generations, the plan's figures and what the worker reported."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from hybridflow.config import load_config
    from hybridflow.engine import GenerateView
    from hybridflow.engine.hybrid.switch import RolloutShard
    from hybridflow.models import build_tiny_model
    from hybridflow.workers.actor import ActorWorker

    lines: list[tuple[int, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Stage switch"):
                lines.append((record.levelno, record.getMessage()))

    log = logging.getLogger("hybridflow.engine.hybrid.actor")
    keep, level = Keep(), log.level
    log.addHandler(keep)
    log.setLevel(logging.DEBUG)
    try:
        cfg = load_config(None, ["data.max_response_length=4", *overrides])
        model = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=5)
        worker = ActorWorker(model, cfg, total_steps=1, pad_token_id=0)
        params = worker.sampling_params(2, 1.0, 1.0, -1, True, [], 7)
        view = GenerateView(cfg.trainer.world_size, cfg.rollout.tensor_model_parallel_size)
        # the driver hands every rank of a rollout group the group's prompts: its ranks' shares together
        together = Batch.concat([prompts(r) for r in view.group_ranks(view.dp_rank(rank))])
        received = [worker.generate(together, params).meta.get("reshard") for _ in range(2)]
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    plan = worker.hybrid.weights.plan if isinstance(worker.hybrid.weights, RolloutShard) else None
    figures = None
    if plan is not None:
        figures = {
            "received": [plan.bytes_received(r) for r in range(plan.view.world)],
            "whole": plan.full_bytes(),
        }
    params_bytes = sum(p.numel() for p in worker.hf_model.parameters())
    return {"lines": lines, "figures": figures, "received": received, "elements": params_bytes}


def test_one_rank_reads_the_training_weights_in_place() -> None:
    (r,) = run_world_kept(1, switch_lines, "qwen2", [])
    text = "Stage switch: nothing copied, the rollout reads the training weights in place (one rank)"
    assert r["lines"] == [(logging.INFO, text), (logging.DEBUG, text)]  # the same figure: DEBUG after
    assert r["received"] == [None, None]


def test_one_rank_with_a_cast_counts_the_cast_bytes() -> None:
    from hybridflow.utils.errors import format_bytes

    (r,) = run_world_kept(1, switch_lines, "qwen2", ["rollout.dtype=bfloat16"])
    (level, text), _ = r["lines"]
    cast = format_bytes(r["elements"] * 2)  # every float32 weight once, in bfloat16
    assert level == logging.INFO
    assert text.endswith(f"in place (one rank); {cast} cast to torch.bfloat16 into its buffers")


def test_one_rank_on_the_hf_fallback_copies_its_replica_locally() -> None:
    from hybridflow.utils.errors import format_bytes

    (r,) = run_world_kept(1, switch_lines, "gpt2", [])
    (level, text), (again, _) = r["lines"]
    whole = format_bytes(r["figures"]["whole"])
    assert (level, again) == (logging.INFO, logging.DEBUG)
    assert text == (
        f"Stage switch: nothing received (one rank); {whole} copied locally into the rollout's replica "
        f"(a whole copy is {whole})"
    )


@pytest.mark.slow
def test_two_ranks_tensor_parallel_say_what_the_plan_moves() -> None:
    from hybridflow.utils.errors import format_bytes

    results = run_world_kept(
        2, switch_lines, "qwen2", ["trainer.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2"]
    )
    r = results[0]
    most, whole = max(r["figures"]["received"]), r["figures"]["whole"]
    assert 0 < most < whole
    amount = format_bytes(most) if len(set(r["figures"]["received"])) == 1 else f"up to {format_bytes(most)}"
    text = f"Stage switch: {amount} received per rank into a 1/2 tensor-parallel shard (a whole copy is {format_bytes(whole)})"
    assert r["lines"] == [(logging.INFO, text), (logging.DEBUG, text)]
    for rank, res in enumerate(results):  # what each rank reported for the step's metrics is the plan's
        assert [x["bytes"] for x in res["received"]] == [r["figures"]["received"][rank]] * 2
