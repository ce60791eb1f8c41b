"""A rollout pool beside the trainer's (``trainer.async_mode=separate``): ranks that only generate.

A rank of the pool holds no training state: a skeleton of the policy on the meta device gives the names and
shapes, its generation shard (a module of the policy's class with the rollout group's local sizes) is filled
by the trainer pool's weight stream (``PoolSync`` over a ``Bridge``), and the built-in engine generates on
it. The pool keeps the version of the weights it holds (the updates the trainer had made when it pushed
them), stamps every batch with it, and counts its busy seconds so the driver can report how idle it was.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from hybridflow.config.schema import Config
from hybridflow.engine import (
    Bridge,
    GenerateView,
    PoolSync,
    RolloutGroup,
    RolloutTP,
    SamplingParams,
    check_tp,
    default_device,
    fallback_reason,
    make_rollout,
    to_dtype,
)
from hybridflow.models.families import check_tensor_parallel
from hybridflow.protocol import Batch
from hybridflow.utils.dist import init_distributed, world_size
from hybridflow.utils.errors import UserError
from hybridflow.utils.logging import rank as dist_rank
from hybridflow.workers.actor_settings import max_model_len, rollout_options
from hybridflow.workers.dispatch import DataCoord, generate_coord
from hybridflow.workers.rollout_batch import sample_batch

logger = logging.getLogger(__name__)


def connect_pools(
    model: nn.Module,
    cfg: Config,
    address: tuple[str, int],
    bridge_rank: int,
    trainers: int,
    pool: int,
    dtype: torch.dtype,
    device: torch.device,
    train_view: str | None = None,
) -> PoolSync:
    """Join the bridge of ``trainers`` + ``pool`` ranks (trainer pool first) and plan the stream; every rank
    of both pools calls it together. ``model``: a trainer rank's training module, or a rollout rank's
    skeleton."""
    r = cfg.rollout
    bridge = Bridge(address, bridge_rank, trainers + pool, device, cfg.trainer.nccl_timeout)
    view = GenerateView.of(cfg, pool, first=trainers)
    bucket = r.update_weights_bucket_megabytes * 2**20
    fp8 = r.quantization == "fp8"  # projections in FP8 on the wire and in the pool's shards
    return PoolSync(model, view, dtype, device, bucket, bridge, train_view, fp8)


class RolloutWorker:
    """One rank of the rollout pool (role ``rollout``): generation weights streamed in, nothing trained."""

    def __init__(self, skeleton: nn.Module, cfg: Config, pad_token_id: int) -> None:
        """``skeleton``: the policy on the meta device (its class, config and parameter names)."""
        init_distributed()
        reason = fallback_reason(skeleton, max_model_len(cfg))
        if reason is not None:  # before any shard rule is looked up: the pool has no HF generate to fall to
            raise UserError(
                f"trainer.async_mode=separate generates on the built-in engine, which does not run this model "
                f"({reason}); set trainer.async_mode=sync (HF generate on the trainer's ranks)"
            )
        self.cfg, self.skeleton, self.pad_token_id = cfg, skeleton, pad_token_id
        self.view = GenerateView.of(cfg, world_size())
        if self.view.tp > 1:
            check_tensor_parallel(skeleton.config, "rollout.tensor_model_parallel_size", self.view.tp)
            check_tp(skeleton.config, self.view.tp, self.view.ep)
        self.group = RolloutGroup(self.view, dist_rank())  # collective over the pool's own world
        self.device = default_device()
        self.sync: PoolSync | None = None
        self.rollout: Any = None
        self.version = -1  # no weights until the trainer's first push
        self.started, self.busy = time.perf_counter(), 0.0

    def rollout_coord(self) -> DataCoord:
        """This rank's rollout group inside the pool: the driver hands its ranks one share of the prompts."""
        return generate_coord(self.view, dist_rank())

    def data_coord(self) -> DataCoord:
        """The pool has no training view: its coordinate is the rollout group's."""
        return self.rollout_coord()

    def join(self, address: tuple[str, int], trainers: int, dtype: str) -> None:
        """Join the bridge after the trainer pool's ``trainers`` ranks and build the engine on the shard the
        stream fills (in ``dtype``, the trainer's rollout dtype)."""
        me, pool = dist_rank(), world_size()
        self.sync = connect_pools(
            self.skeleton, self.cfg, address, trainers + me, trainers, pool, to_dtype(dtype), self.device
        )
        assert self.sync.module is not None, "a rollout pool's rank receives a shard"
        vocab = self.skeleton.config.vocab_size
        tp = RolloutTP(self.group.group, vocab) if self.view.tp > 1 else None
        self.rollout = make_rollout(
            self.sync.module, "native", pad_token_id=self.pad_token_id, dtype=to_dtype(dtype), device=self.device,
            max_model_len=max_model_len(self.cfg), **rollout_options(self.cfg), **({"tp": tp} if tp else {}),
        )  # fmt: skip
        if me == 0:
            logger.info("%s", self.sync.sync_line())

    def receive(self, version: int) -> dict[str, float]:
        """Take the trainer pool's weights of ``version`` (the collective with its ``push_weights``); the
        seconds this rank spent in it and the bytes it received."""
        assert self.sync is not None, "join the bridge first"
        start = time.perf_counter()
        received = self.sync.sync()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.busy += seconds
        self.version = version
        return {"seconds": seconds, "bytes": float(received)}

    def generate(self, prompts: Batch, params: SamplingParams, desc: str = "rollout") -> Batch:
        """``ActorWorker.generate`` on the pool's weights: ``meta["weight_version"]`` is their version and
        ``meta["pool_clock"]`` this rank's busy and wall seconds since it started."""
        assert self.version >= 0, "the pool generates after the trainer's first push"
        start = time.perf_counter()
        R, pad = self.cfg.data.max_response_length, self.pad_token_id
        batch = sample_batch(self.rollout, self.group, prompts, params, R, pad, desc)
        now = time.perf_counter()
        self.busy += now - start
        batch.meta["weight_version"] = self.version
        batch.meta["pool_clock"] = {"busy_s": self.busy, "wall_s": now - self.started, "gen_s": now - start}
        return batch


def rollout_skeleton(model_config: Any) -> nn.Module:
    """The policy of ``model_config`` on the meta device, with the MoE blocks the trainer installs."""
    from transformers import AutoModelForCausalLM

    from hybridflow.models.moe import install_moe

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    install_moe(model)
    return model
