"""The rollout's own weights at data-parallel size 2 (gloo on CPU): the hybrid engine's whole replica (tp = 1),
released and refreshed in place, and the baseline's kept copy refreshed by a rank-0 broadcast."""

from __future__ import annotations

import copy

import torch
from support.dist_util import run_world_kept as run_world
from support.row_cache import RowCache

from hybridflow.models import build_tiny_model


def round_trip(rank: int, hybrid: bool) -> dict:
    import torch.distributed as dist

    from hybridflow.engine.hybrid.switch import BroadcastReplica, RolloutShard
    from hybridflow.engine.parallel.fsdp import full_state_dict, shard_model
    from hybridflow.engine.parallel.view import GenerateView
    from hybridflow.engine.rollout.model import LlamaRunner

    dist.init_process_group("gloo")
    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, seed=1)  # tied embedding and LM head
    sharded = copy.deepcopy(lm)
    shard_model(sharded, list(sharded.model.layers), torch.device("cpu"))
    cpu = torch.device("cpu")
    if hybrid:
        weights = RolloutShard(sharded, GenerateView(2, 1), rank, torch.float32, cpu, bucket_bytes=1 << 20)
    else:
        weights = BroadcastReplica(sharded, torch.float32, cpu)
    runner = LlamaRunner(weights.module)  # binds the weights' tensors, as the worker's rollout does
    with torch.no_grad():
        for p in sharded.parameters():  # a "training step" on the shards
            p.to_local().mul_(-0.5)
    received = weights.sync(sharded)
    want = full_state_dict(sharded)  # a collective: every rank gathers
    first = {k: v.clone() for k, v in weights.module.state_dict().items()}
    distinct = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in weights.module.parameters()
    }
    freed = weights.release()
    emptied = all(p.untyped_storage().nbytes() == 0 for p in weights.module.parameters())
    with torch.no_grad():
        for p in sharded.parameters():
            p.to_local().mul_(2.0)
    weights.sync(sharded)
    second = weights.module.state_dict()
    ids, one = torch.tensor([[3, 4, 5]]), torch.tensor([3])
    moved = runner.refresh()  # the storages were re-allocated in place: the bindings still hold
    logits = RowCache(runner, 1, 8).prefill(ids, one)
    fresh = RowCache(LlamaRunner(weights.module), 1, 8).prefill(ids, one)
    return {
        "first": first,
        "second": {k: v.clone() for k, v in second.items()},
        "want": want,
        "received": received,
        "freed": freed,
        "distinct_bytes": sum(distinct.values()),
        "emptied": emptied,
        "tied": weights.module.lm_head.weight is weights.module.model.embed_tokens.weight,
        "moved": moved,
        "same_logits": torch.equal(logits, fresh),
    }


def test_the_hybrid_replica_is_released_and_comes_back_with_the_current_weights_under_the_same_tensors() -> (
    None
):
    out = run_world(2, round_trip, True)
    want = out[0]["want"]
    for r in out:
        assert all(torch.equal(r["first"][k], want[k]) for k in want)
        assert all(torch.equal(r["second"][k], 2 * want[k]) for k in want)
        assert r["emptied"] and r["tied"] and r["moved"] is False and r["same_logits"]
        assert r["freed"] == r["distinct_bytes"] > 0  # the tied embedding counted once
        assert r["received"] == r["distinct_bytes"] // 2  # the other rank's half of every tensor


def test_the_baseline_keeps_a_whole_copy_refreshed_by_a_broadcast_from_rank_0() -> None:
    out = run_world(2, round_trip, False)
    want = out[0]["want"]
    for r in out:
        assert all(torch.equal(r["first"][k], want[k]) for k in want)
        assert all(torch.equal(r["second"][k], 2 * want[k]) for k in want)
        assert r["freed"] == 0 and not r["emptied"]  # the baseline never lets go of its copy
        assert r["same_logits"]
    assert (
        out[0]["received"] == 0 and out[1]["received"] == out[1]["distinct_bytes"]
    )  # all of it, from rank 0
