"""The first line of a run: the world size and every role's rank layout, from the config alone."""

from __future__ import annotations

import torch

from hybridflow.config.schema import Config
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.engine.parallel.view import GenerateView


def _device(cfg: Config) -> str:
    """``cuda/nccl`` or ``cpu/gloo``, as ``trainer.device`` resolves on this machine."""
    kind = cfg.trainer.device
    cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    return "cuda/nccl" if cuda else "cpu/gloo"


def _train_view(cfg: Config, role: str, world: int) -> str:
    return str(ParallelDims.of(cfg, role, world))


def world_line(cfg: Config) -> str:
    """``world: 4 ranks (1 node x 4, cpu/gloo, local backend); actor train_view=(fsdp=4) ...``.

    Names the views each role trains and generates in (the actor's generation view with its switch: the
    hybrid engine, or the baseline's kept copy), the reference's and the critic's training views, and where
    the critic runs under ``trainer.placement=split``.
    """
    t = cfg.trainer
    world = t.world_size
    nodes = f"{t.nnodes} node{'s' if t.nnodes > 1 else ''} x {t.n_gpus_per_node}"
    head = f"world: {world} rank{'s' if world > 1 else ''} ({nodes}, {_device(cfg)}, {t.backend} backend)"
    generate = GenerateView.of(cfg, world)
    switch = "hybrid engine" if cfg.actor.hybrid_engine else "baseline: a kept copy per rank"
    roles = [f"actor train_view={_train_view(cfg, 'actor', world)} generate_view={generate} ({switch})"]
    if cfg.use_reference:
        roles.append(f"reference train_view={_train_view(cfg, 'ref', world)}")
    if cfg.use_critic:
        where = f" on {world} ranks of its own" if t.placement == "split" else ""
        roles.append(f"critic train_view={_train_view(cfg, 'critic', world)}{where}")
    if cfg.reward.model.enable:
        roles.append("reward model")
    return f"{head}; {'; '.join(roles)}"
