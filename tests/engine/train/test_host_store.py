"""The optimizer moments' exact-size host home: copies in place, one buffer, DTensors kept as DTensors.

Pinning needs a GPU (``tests/engine/test_train_engine_gpu.py``); here the store runs unpinned on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from support.dist_util import run_world_kept as run_world

from hybridflow.engine.train.host_store import HostStore


def test_stash_copies_into_one_exact_buffer_and_reuses_it() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(2, dtype=torch.bfloat16)]
    store = HostStore(pin=False)
    homes = store.stash(tensors)
    assert all(torch.equal(h, t) and h.dtype == t.dtype for h, t in zip(homes, tensors))
    assert store.nbytes == 3 * 256  # each home on a 256-byte boundary: 60, 56 and 4 bytes round up
    start = store.flat.data_ptr()
    assert [h.data_ptr() - start for h in homes] == [0, 256, 512]

    tensors[0].fill_(2.0)  # a later offload of the same tensors writes the same memory
    again = store.stash(tensors)
    assert store.flat.data_ptr() == start and again[0].data_ptr() == start
    assert torch.equal(again[0], torch.full((3, 5), 2.0)) and torch.equal(homes[0], again[0])

    other = store.stash([torch.ones(4)])  # another layout: a new buffer of its size
    assert store.nbytes == 256 and torch.equal(other[0], torch.ones(4))
    store.release()
    assert store.nbytes == 0 and store.homes == []


def tiny_engine(vocab: int, seed: int) -> tuple:
    """A CPU ``TrainEngine`` (AdamW, lr 1e-2) over a tiny LM of ``vocab`` tokens, and a batch (2, 12) of ids."""
    from hybridflow.config.schema import FSDPConfig, OptimConfig
    from hybridflow.engine.parallel.parallelize import parallelize
    from hybridflow.engine.train.train_engine import TrainEngine
    from hybridflow.models import build_tiny_model

    model = build_tiny_model("qwen2", vocab_size=vocab, hidden_size=32, num_hidden_layers=2, seed=1)
    parallel = parallelize(model, None, FSDPConfig(), trainable=True, compile=False)
    engine = TrainEngine(parallel, FSDPConfig(), OptimConfig(lr=1e-2))
    return engine, torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def train_steps(engine, ids: torch.Tensor, between: Callable[[], None] | None) -> None:
    """Three AdamW steps on ``ids``, calling ``between`` after each."""
    for _ in range(3):
        engine.module(input_ids=ids, labels=ids).loss.backward()
        engine.optimizer_step()
        if between is not None:
            between()


def train(rank: int, store: bool) -> dict:
    """Three AdamW steps on a tiny LM, the moments moved to a store (or not) between the steps."""
    from hybridflow.engine.train.offload import move_optimizer

    engine, ids = tiny_engine(vocab=64, seed=0)
    kinds = []

    def offload() -> None:
        move_optimizer(engine.optimizer, "cpu", pin=False, store=engine.moment_store)
        moment = engine.optimizer.state[next(iter(engine.optimizer.state))]["exp_avg"]
        flat = engine.moment_store.flat
        inside = flat.data_ptr() <= moment.to_local().data_ptr() < flat.data_ptr() + flat.numel()
        kinds.append((type(moment).__name__, tuple(moment.placements), inside))

    train_steps(engine, ids, offload if store else None)
    params = [p.to_local().detach().clone() for p in engine.module.parameters()]
    moments = [
        v.to_local().clone() for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"
    ]
    return {"params": params, "moments": moments, "kinds": kinds}


def test_moments_in_the_store_train_as_they_would_in_place() -> None:
    (stored,) = run_world(1, train, True)
    (plain,) = run_world(1, train, False)
    assert all(kind == ("DTensor", stored["kinds"][0][1], True) for kind in stored["kinds"])
    for a, b in zip(stored["params"] + stored["moments"], plain["params"] + plain["moments"]):
        assert torch.equal(a, b)


def train_sharded(rank: int, store: bool) -> dict:
    """Three AdamW steps on two ranks whose 65-row embedding splits unevenly (FSDP2 pads its shard),
    the parameters moved to a store and back to fresh memory (as onload does) between the steps."""
    from hybridflow.engine.parallel.fsdp import local_bytes
    from hybridflow.engine.train.offload import _padded, move_model, pinned_param_bytes

    engine, ids = tiny_engine(vocab=65, seed=rank)
    params = list(engine.module.parameters())
    padded = [_padded(p) for p in params]
    homes = []

    def offload_and_back() -> None:
        move_model(engine.module, "cpu", pin=False, store=engine.param_store)
        flat = engine.param_store.flat
        start, end = flat.data_ptr(), flat.data_ptr() + flat.numel()
        homes.append([start <= p.to_local().data_ptr() < end for p in engine.module.parameters()])
        engine.module._apply(lambda t: t.clone())  # onload: every shard into memory of its own again

    train_steps(engine, ids, offload_and_back if store else None)
    even = sum(local_bytes([p]) for p, pad in zip(params, padded) if not pad)
    return {
        "padded": padded,
        "homes": homes,
        "store_bytes": engine.param_store.nbytes,
        "even_bytes": even,
        "pinned_bytes": pinned_param_bytes(engine.module),
        "padded_bytes": sum(local_bytes([p]) for p, pad in zip(params, padded) if pad),
        "same_objects": all(a is b for a, b in zip(params, engine.module.parameters())),
        "params": [p.to_local().detach().clone() for p in engine.module.parameters()],
    }


def test_parameters_offload_into_the_store_except_padded_shards_and_train_the_same() -> None:
    stored = run_world(2, train_sharded, True)
    plain = run_world(2, train_sharded, False)
    for rank, (got, want) in enumerate(zip(stored, plain)):
        assert any(got["padded"]) == (rank == 1)  # 65 rows: 33 on rank 0, 32 (padded to 33) on rank 1
        assert got["homes"] == [[not pad for pad in got["padded"]]] * 3  # the same homes at every offload
        assert got["even_bytes"] <= got["store_bytes"] < got["even_bytes"] + 256 * len(got["padded"])
        assert got["pinned_bytes"] == got["even_bytes"] + 2 * got["padded_bytes"]
        assert got["same_objects"]  # the optimizer's parameters are still the module's
        for a, b in zip(got["params"], want["params"]):
            assert torch.equal(a, b)
