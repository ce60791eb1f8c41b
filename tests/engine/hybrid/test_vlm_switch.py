"""The hybrid engine's switch for a vision-language model at data-parallel size 2 (gloo on CPU): the vision tower
travels whole to each rank's replica; frozen (``model.freeze_vision_tower``), it is delivered at the first
switch only and kept through ``release()``, while the text layers come every time; the replica then generates
from image prompts as the whole model does. A rollout tensor-parallel group is refused for a VLM."""

from __future__ import annotations

import copy

import pytest
import torch
from support.dist_util import run_world_kept as run_world


def switch_twice(rank: int, freeze: bool) -> dict:
    import torch.distributed as dist
    from support.vlm_cases import lively_vl_model, prompts

    from hybridflow.engine.hybrid.switch import RolloutShard
    from hybridflow.engine.parallel.fsdp import shard_model
    from hybridflow.engine.parallel.view import GenerateView
    from hybridflow.engine.rollout.engine import PagedEngine
    from hybridflow.engine.rollout.sampling import SamplingParams

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model, processor = lively_vl_model()
    model.model.visual.requires_grad_(not freeze)
    sharded = copy.deepcopy(model)
    shard_model(sharded, [*sharded.model.language_model.layers, sharded.model.visual], torch.device("cpu"))
    cpu = torch.device("cpu")
    weights = RolloutShard(sharded, GenerateView(2, 1), rank, torch.float32, cpu, bucket_bytes=1 << 16)
    first = weights.sync(sharded)
    engine = PagedEngine(weights.module, block_size=8)  # binds the replica's tensors, as the worker does
    weights.release()
    with torch.no_grad():  # a "training step" on the shards of the trained parameters
        for p in sharded.parameters():
            if p.requires_grad:
                p.to_local().mul_(0.9)
    second = weights.sync(sharded)
    trained = copy.deepcopy(model)  # the same step on a whole copy
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.mul_(0.9)
    want, got = trained.state_dict(), weights.module.state_dict()
    ids, mms = prompts(processor)
    params = SamplingParams(n=2, max_new_tokens=8, do_sample=False)
    return {
        "first": first,
        "second": second,
        "skipped": weights.last_skipped_bytes,
        "line": weights.switch_line(),
        "equal": all(torch.equal(got[k], want[k]) for k in want),
        "tower_bytes": sum(p.numel() * p.element_size() for p in model.model.visual.parameters()),
        "got": [[s.token_ids for s in g] for g in engine.generate(ids, params, mm_inputs=mms)],
        "want": [
            [s.token_ids for s in g]
            for g in PagedEngine(trained, block_size=8).generate(ids, params, mm_inputs=mms)
        ],
    }


def refuse_tp(rank: int) -> str:
    import torch.distributed as dist
    from support.vlm_cases import lively_vl_model

    from hybridflow.engine.hybrid.switch import RolloutShard
    from hybridflow.engine.parallel.view import GenerateView
    from hybridflow.utils.errors import UserError

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model, _ = lively_vl_model()
    try:
        RolloutShard(
            model, GenerateView(2, 2), rank, torch.float32, torch.device("cpu"), bucket_bytes=1 << 16
        )
    except UserError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("freeze", [True, False])
def test_a_frozen_vision_tower_is_delivered_at_the_first_switch_only(freeze: bool) -> None:
    out = run_world(2, switch_twice, freeze)
    for r in out:
        assert r["equal"] and r["got"] == r["want"], (r["got"], r["want"])
        if freeze:  # each rank receives the other rank's half of the tower once
            assert r["skipped"] == r["tower_bytes"] // 2 > 0
            assert r["second"] == r["first"] - r["skipped"]
            assert "frozen vision tower" in r["line"]
        else:
            assert r["skipped"] == 0 and r["second"] == r["first"]


def test_a_vlm_with_rollout_tensor_parallelism_is_refused() -> None:
    for message in run_world(2, refuse_tp):
        assert "rollout.tensor_model_parallel_size=2" in message
