"""A process group across two worlds (``Bridge``): the channel of ``trainer.async_mode=separate``.

Gloo processes in two worlds of their own, as Ray worker groups have: a trainer pool of 2 ranks (its default
group, FSDP2 shards over it) and a rollout pool of 2 tensor-parallel ranks. The bridge's object gather
and uneven all-to-all match what each rank sent; ``PoolSync`` over the bridge fills every rollout rank's
generation shard bit-exact, twice in the same tensors.
"""

from __future__ import annotations

import copy

import torch
from support.dist_util import run_world
from test_pool_sync import _mismatches, full_weights

from hybridflow.engine.hybrid.bridge import Bridge
from hybridflow.engine.hybrid.pool_sync import PoolSync
from hybridflow.engine.parallel.view import GenerateView
from hybridflow.utils.dist import free_port


def _join_world(rank: int, trainers: int, rollout: int, ports: tuple[int, int]) -> int:
    """This process's own world: the trainer pool's (ranks 0..T-1) or the rollout pool's; its rank there."""
    import torch.distributed as dist

    pool = int(rank >= trainers)
    mine, size = (rank, trainers) if pool == 0 else (rank - trainers, rollout)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[pool]}", rank=mine, world_size=size)
    return mine


def exchange(rank: int, spec: dict) -> dict:
    """The bridge's collectives and a ``PoolSync`` over it, from this rank of the two pools."""
    import torch.distributed as dist

    from hybridflow.engine.parallel.fsdp import shard_model
    from hybridflow.engine.rollout.tp import meta_model

    T, R, tp = spec["trainers"], spec["rollout"], spec["tp"]
    mine = _join_world(rank, T, R, spec["worlds"])
    cpu = torch.device("cpu")
    bridge = Bridge(("127.0.0.1", spec["bridge"]), rank, T + R, cpu, 60.0)
    out: dict = {"gathered": bridge.gather_objects({"rank": rank, "pad": "x" * (rank * 37)})}
    send = torch.arange(sum(range(1, T + R + 1)), dtype=torch.float32) + 100 * rank  # r + 1 elements to r
    splits = list(range(1, T + R + 1))
    recv = torch.empty((rank + 1) * (T + R))
    bridge.all_to_all(recv, send, [rank + 1] * (T + R), splits)
    out["recv"] = recv.tolist()
    lm = full_weights("qwen2")
    view = GenerateView(R, tp, first=T)
    trainer = None
    if rank < T:
        trainer = copy.deepcopy(lm)
        trainer = shard_model(trainer, list(trainer.model.layers), cpu)  # FSDP2 over the trainer pool's world
    sync = PoolSync(
        trainer if trainer is not None else meta_model(lm), view, torch.float32, cpu, 1 << 13, bridge
    )
    sync.sync(trainer)
    if trainer is not None:
        with torch.no_grad():
            for p in trainer.parameters():
                getattr(p, "_local_tensor", p).mul_(-0.5)
    ptrs = None if sync.module is None else [p.data_ptr() for p in sync.module.parameters()]
    sync.sync(trainer)
    if sync.module is not None:
        out["wrong"] = _mismatches(sync, lm, view.tp_rank(rank), torch.float32, -0.5)
        out["same_tensors"] = ptrs == [p.data_ptr() for p in sync.module.parameters()]
    out["world"] = (dist.get_rank(), dist.get_world_size(), mine)
    return out


def test_a_bridge_joins_two_worlds_and_streams_the_weights_bit_exact() -> None:
    rollout, tp = 2, 2  # (the trainer tests run a pool of one rank)
    spec = dict(trainers=2, rollout=rollout, tp=tp, worlds=(free_port(), free_port()), bridge=free_port())
    results = run_world(2 + rollout, exchange, spec, timeout=120)
    size = 2 + rollout
    for rank, out in enumerate(results):
        assert out["gathered"] == [{"rank": r, "pad": "x" * (r * 37)} for r in range(size)]
        # rank r received r + 1 elements from every sender s: s's slice starting after 1 + ... + r elements
        start = sum(range(1, rank + 1))
        want = [float(start + i + 100 * s) for s in range(size) for i in range(rank + 1)]
        assert out["recv"] == want, rank
        pool_size = 2 if rank < 2 else rollout
        assert out["world"][1] == pool_size  # each process's own world is its pool's, not the bridge
        if rank >= 2:
            assert out["wrong"] == [] and out["same_tensors"], rank
