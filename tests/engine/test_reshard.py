"""The rollout replica at data-parallel size 2 (gloo on CPU): refreshed from shards, released, refreshed again."""

from __future__ import annotations

import copy

import torch
from dist_util import run_world

from hybridflow.models import build_tiny_model


def replica_round_trip(rank: int) -> dict:
    from hybridflow.engine.fsdp import full_state_dict, shard_model
    from hybridflow.engine.reshard import RolloutReplica
    from hybridflow.engine.rollout.model import LlamaRunner

    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, seed=1)  # tied embedding and LM head
    replica = RolloutReplica(lm, torch.float32, torch.device("cpu"), 2)
    sharded = copy.deepcopy(lm)
    shard_model(sharded, list(sharded.model.layers), torch.device("cpu"))
    runner = LlamaRunner(replica.module)  # binds the replica's tensors, as the worker's rollout does
    with torch.no_grad():
        for p in sharded.parameters():  # a "training step" on the shards
            p.to_local().mul_(-0.5)
    replica.sync(sharded)
    want = {k: v for k, v in full_state_dict(sharded).items()}
    first = {k: v.clone() for k, v in replica.module.state_dict().items()}
    bytes_before = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in replica.params.values()
    }
    freed = replica.release()
    emptied = all(p.untyped_storage().nbytes() == 0 for p in replica.params.values())
    assert replica.release() == 0  # nothing left to free: a second release reports no bytes
    with torch.no_grad():
        for p in sharded.parameters():
            p.to_local().mul_(2.0)
    replica.sync(sharded)
    second = replica.module.state_dict()
    cache = runner.make_cache(1, 8)
    ids, one = torch.tensor([[3, 4, 5]]), torch.tensor([3])
    moved = runner.refresh()  # the storages were re-allocated in place: the bindings still hold
    logits = runner.prefill(ids, one, torch.tensor([0]), torch.tensor([0]), cache)
    fresh = LlamaRunner(replica.module).prefill(
        ids, one, torch.tensor([0]), torch.tensor([0]), runner.make_cache(1, 8)
    )
    return {
        "first_matches": all(torch.equal(first[k], want[k]) for k in want),
        "second_is_doubled": all(torch.equal(second[k], 2 * want[k]) for k in want),
        "freed": freed,
        "distinct_bytes": sum(bytes_before.values()),
        "emptied": emptied,
        "tied": replica.module.lm_head.weight is replica.module.model.embed_tokens.weight,
        "moved": moved,
        "same_logits": torch.equal(logits, fresh),
    }


def test_a_released_replica_comes_back_with_the_current_weights_under_the_same_tensors() -> None:
    for out in run_world(2, replica_round_trip):
        assert out["first_matches"] and out["second_is_doubled"]
        assert out["emptied"] and out["tied"]
        assert out["freed"] == out["distinct_bytes"] > 0  # the tied embedding counted once
        assert out["moved"] is False and out["same_logits"]
