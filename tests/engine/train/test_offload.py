"""Offload through pinned host memory: the worst-case pool of a host's ranks must fit in its memory."""

from __future__ import annotations

import logging

from support.dist_util import run_world_kept as run_world

from hybridflow.engine.train.offload import pinned_pool_fits


def test_the_pinned_pool_counts_every_rank_on_the_host() -> None:
    assert pinned_pool_fits(20, 4, 100)  # 20 x 4 = 80 <= 80% of 100
    assert not pinned_pool_fits(20, 5, 100)
    assert pinned_pool_fits(10**15, 8, None)  # unknown host memory: assume room


def decisions(rank: int) -> dict:
    """``choose_pinning`` for a real (CPU) engine whose parameters and moments are configured to offload."""
    from hybridflow.config.schema import FSDPConfig, OptimConfig
    from hybridflow.engine.parallel.parallelize import parallelize
    from hybridflow.engine.train.offload import choose_pinning
    from hybridflow.engine.train.train_engine import TrainEngine
    from hybridflow.models import build_tiny_model

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hybridflow.engine.train.offload").addHandler(handler)

    model = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
    n_params = sum(p.numel() for p in model.parameters())
    both = FSDPConfig(param_offload=True, optimizer_offload=True)
    engine = TrainEngine(parallelize(model, None, both, trainable=True, compile=False), both, OptimConfig())
    params, moments = 4 * n_params, 8 * n_params  # float32 parameters, two float32 AdamW moments

    def host(pinned: int) -> float:
        return 2 * pinned / 0.8  # the host memory two such ranks need to pin this much, at the 80% share

    need = host(params + moments)  # one rank: no padded shard, so everything goes to exact-size stores

    def choose(fsdp: FSDPConfig, available: float | None) -> bool:
        return choose_pinning(
            fsdp, engine.module, engine.optimizer, 2, None if available is None else int(available)
        )

    return {
        "roomy": choose(both, need + 1024),
        "short": choose(both, need - 1024),
        "unknown": choose(both, None),
        "params_only_short": choose(FSDPConfig(param_offload=True), host(params) - 1024),
        "params_only_fits": choose(FSDPConfig(param_offload=True), host(params) + 1024),
        "auto_counts_moments": choose(FSDPConfig(optimizer_offload="auto"), host(moments) - 1024),
        "moments_fit_exactly": choose(FSDPConfig(optimizer_offload=True), host(moments) + 1024),
        "not_wanted": choose(FSDPConfig(param_offload=True, pin_memory=False), need + 1024),
        "no_offload": choose(FSDPConfig(), 0),
        "messages": messages,
    }


def test_offload_falls_back_to_pageable_memory_when_the_pool_would_not_fit() -> None:
    (got,) = run_world(1, decisions)
    assert got["roomy"] and got["unknown"] and got["params_only_fits"] and got["moments_fit_exactly"]
    assert not got["short"] and not got["params_only_short"] and not got["auto_counts_moments"]
    assert not got["not_wanted"]  # fsdp.pin_memory=false is the user's choice
    assert got["no_offload"]  # nothing moves: the setting stands as configured
    assert len(got["messages"]) == 3  # one warning per fallback, naming the setting and the fix
    assert all("fsdp.pin_memory" in m and "pageable" in m for m in got["messages"])
