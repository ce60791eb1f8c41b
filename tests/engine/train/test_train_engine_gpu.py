"""On the GPU: offloading a trained role moves its shards and AdamW moments through pinned host memory (unless
``fsdp.pin_memory=false``), each into one exact-size ``HostStore``, and training with offload between steps
computes what training without it does.

Run on the GPU machine with ``pytest -m gpu tests/engine/test_train_engine_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from support.dist_util import run_world

pytestmark = pytest.mark.gpu

STEPS = 3


def train(rank: int, offload: bool, pin: bool = True) -> dict:
    """``STEPS`` AdamW steps on a tiny LM, offloading parameters and moments between them when asked."""
    from hybridflow.config.schema import FSDPConfig, OptimConfig
    from hybridflow.engine.parallel.parallelize import parallelize
    from hybridflow.engine.train.train_engine import TrainEngine
    from hybridflow.models import build_tiny_model

    model = build_tiny_model("qwen2", vocab_size=128, hidden_size=64, num_hidden_layers=2, seed=1)
    fsdp = FSDPConfig(param_offload=offload, optimizer_offload=offload, pin_memory=pin)
    engine = TrainEngine(
        parallelize(model, None, fsdp, trainable=True, compile=False), fsdp, OptimConfig(lr=1e-2)
    )
    ids = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(0))  # (B, T)
    host: list[bool] = []
    homes: list[bool] = []  # every moment's host copy inside the engine's one exact-size store
    for _ in range(STEPS):
        engine.onload()
        loss = engine.module(input_ids=ids.cuda(), labels=ids.cuda()).loss
        loss.backward()
        engine.optimizer_step()
        engine.offload()
        shards = [p.to_local() for p in engine.module.parameters()]
        shards += [s["exp_avg_sq"].to_local() for s in engine.optimizer.state.values()]  # DTensors too
        host.append(all(t.device.type == "cpu" and t.is_pinned() for t in shards))
        homes.append(offload and in_store(engine))
    # Read on the host right after the offload: the values must be there without any further sync.
    params = [p.to_local().detach().cpu().clone() for p in engine.module.parameters()]
    moments = [s["exp_avg"].to_local().cpu().clone() for s in engine.optimizer.state.values()]
    return {"host_pinned": host, "in_store": homes, "params": params, "moments": moments, "loss": float(loss)}


def in_store(engine) -> bool:
    """Whether the host copies of the shards and of the moments are views of the engine's two
    ``HostStore``s, each of their exact size (one rank: no shard is padded)."""
    moments = [v.to_local() for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]
    shards = [p.to_local() for p in engine.module.parameters()]
    return exactly_in(engine.moment_store, moments) and exactly_in(engine.param_store, shards)


def exactly_in(store, tensors: list[torch.Tensor]) -> bool:
    """Every tensor inside ``store``'s buffer, which is their bytes, each padded to 256 at most."""
    start, n = store.flat.data_ptr(), store.nbytes
    inside = all(start <= t.data_ptr() and t.data_ptr() + t.nbytes <= start + n for t in tensors)
    exact = sum(t.nbytes for t in tensors)
    return inside and exact <= n < exact + 256 * len(tensors)


@pytest.mark.parametrize("pin", [True, False])
def test_offload_leaves_training_unchanged_and_pins_as_configured(pin: bool) -> None:
    (offloaded,) = run_world(1, train, True, pin)
    (resident,) = run_world(1, train, False)
    assert offloaded["host_pinned"] == [pin] * STEPS  # fsdp.pin_memory=false: pageable host copies
    assert resident["host_pinned"] == [False] * STEPS  # nothing moves without offload
    assert offloaded["in_store"] == [True] * STEPS  # the same exact-size home at every offload
    assert offloaded["loss"] == resident["loss"]
    for a, b in zip(offloaded["params"] + offloaded["moments"], resident["params"] + resident["moments"]):
        assert torch.equal(a, b)
