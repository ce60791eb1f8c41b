"""The hybrid actor on its own (no worker, no config): one policy's training and generation views and the
switch between them, at one rank (the rollout reads the training weights in place) and on two gloo ranks (a
generation replica refreshed from the FSDP2 shards by the reshard plan), and the table of what needs the
built-in engine."""

from __future__ import annotations

import logging

import pytest
from support.dist_util import run_world_kept

from hybridflow.config.schema import ActorConfig
from hybridflow.engine import (
    BUILT_IN_NEEDS,
    GenerateView,
    HybridActor,
    HybridSettings,
    ParallelDims,
    SamplingParams,
)
from hybridflow.models import build_tiny_model
from hybridflow.utils.errors import UserError

PROMPTS = [[5, 9, 3, 7, 2, 11, 4], [8, 1], [6, 6, 6, 12], [3, 14, 9]]  # different lengths


def _actor(arch: str, world: int, rank: int, **overrides) -> HybridActor:
    from hybridflow.utils.dist import init_distributed

    init_distributed()
    model = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=3)
    dims = ParallelDims(world, rank=rank)
    settings = HybridSettings(
        update_section=dims.budgets(ActorConfig()), total_steps=1, max_model_len=32,
        rollout_options={"max_num_seqs": 8, "free_cache_engine": True}, **overrides,
    )  # fmt: skip
    return HybridActor(model, dims, GenerateView(world), settings, rank, pad_token_id=0)


def _greedy(actor: HybridActor) -> list[list[int]]:
    params = SamplingParams(n=1, max_new_tokens=6, temperature=0.0, do_sample=False, eos_token_ids=[])
    return [g[0].token_ids for g in actor.rollout.generate(PROMPTS, params)]


def _switch(rank: int, world: int) -> dict:
    actor = _actor("qwen2", world, rank)
    before = actor.release()  # nothing held yet: the switch allocates the generation weights
    figures = actor.to_generation()
    out = {"tokens": _greedy(actor), "figures": figures, "line": actor.switch_line, "released_before": before}
    if actor.weights is not None:
        plan = actor.weights.plan
        out["planned"] = plan.bytes_received(rank)
        actor.after_generation()
        out["after"] = sum(
            t.numel() for t in actor.weights.module.parameters() if t.numel() and t.untyped_storage().size()
        )
    return out


def test_at_one_rank_the_rollout_reads_the_training_weights_in_place() -> None:
    (one,) = run_world_kept(1, _switch, 1)
    assert one["figures"] is None and "nothing copied" in one["line"]
    assert [len(t) for t in one["tokens"]] == [6, 6, 6, 6]


def test_on_two_ranks_the_switch_moves_what_the_plan_says_and_generates_as_one_rank() -> None:
    (one,) = run_world_kept(1, _switch, 1)
    two = run_world_kept(2, _switch, 2)
    for out in two:
        assert out["figures"]["bytes"] == out["planned"] > 0  # each rank received exactly its plan's bytes
        assert out["tokens"] == one["tokens"]  # the refreshed replica generates what one rank's weights do
        assert out["after"] == 0  # free_cache_engine: the generation replica released after the rollout
        assert out["line"].startswith("Stage switch") and "nothing copied" not in out["line"]


def _refusal(rank: int, world: int, needs: tuple[str, ...]) -> str:
    try:
        actor = _actor("gpt2", world, rank, needs=needs)
    except UserError as exc:
        return f"refused: {exc}"
    return f"built: {type(actor.rollout).__name__}"


# tp > 1 is refused before this table for a family without shard rules (tests/models/test_families.py)
@pytest.mark.parametrize("need", sorted(set(BUILT_IN_NEEDS) - {"tp"}))
def test_what_needs_the_built_in_engine_is_refused_for_a_family_it_does_not_run(need: str) -> None:
    (answer,) = run_world_kept(1, _refusal, 1, (need,))
    setting, _, fix = BUILT_IN_NEEDS[need]
    assert answer.startswith("refused: ") and setting in answer and fix in answer and "gpt2" in answer, answer


def test_a_family_it_does_not_run_falls_back_to_hf_generate_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="hybridflow.engine.hybrid.actor"):
        answer = _refusal(0, 1, ())
    assert answer == "built: HFRollout"
    warned = [r for r in caplog.records if "gpt2" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
