"""The reference policy: a frozen copy of the initial actor, forward only (optionally kept on CPU); with LoRA
the actor's own module with its adapters off (``AdapterReference``: no second copy of the weights)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from hybridflow.config.schema import Config
from hybridflow.engine import ActorEngine, ParallelDims, adapters_disabled
from hybridflow.protocol import Batch
from hybridflow.utils.dist import init_distributed, world_size
from hybridflow.utils.logging import rank as dist_rank
from hybridflow.workers.dispatch import DataCoord, train_coord


def ref_log_prob(engine: ActorEngine, cfg: Config, dims: ParallelDims) -> Callable[[Batch], Batch]:
    """The reference pass over ``engine``: ``ref_log_prob`` (B, R) at the rollout temperature."""

    def run(batch: Batch) -> Batch:
        ref = cfg.ref
        out = engine.compute_log_prob(
            batch,
            temperature=cfg.rollout.temperature,
            micro_batch_size=ref.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=ref.log_prob_use_dynamic_bsz,
            max_token_len=dims.token_budget(ref.log_prob_max_token_len_per_gpu),
        )
        return Batch({"ref_log_prob": out["log_probs"]})

    return run


class ReferenceWorker:
    """Log-probs of the responses under the reference weights (``ref_log_prob``)."""

    def __init__(self, model: nn.Module, cfg: Config, pad_token_id: int = 0) -> None:
        self.cfg = cfg
        init_distributed()
        dims = ParallelDims.of(cfg, "ref", world_size(), dist_rank())
        dims.check_model(model.config)
        self.engine = ActorEngine(
            model,
            dims.budgets(cfg.actor),
            rollout_n=cfg.rollout.n,
            use_remove_padding=cfg.model.use_remove_padding,
            trainable=False,
            fsdp=cfg.ref.fsdp,
            dims=dims,
        )
        self.dims = self.engine.dims  # with its process groups

    def data_coord(self) -> DataCoord:
        """This rank's model replica in the reference's view: the driver hands its ranks one share of a batch."""
        return train_coord(self.dims, dist_rank())

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob`` (B, R) at the rollout temperature."""
        return ref_log_prob(self.engine, self.cfg, self.dims)(batch)


class AdapterReference:
    """The reference of a LoRA actor: the actor's module with every adapter off, i.e. the base model.

    Nothing is copied: the pass runs the actor's own (sharded) module on its training view, adapters
    disabled for its duration (``engine.adapters_disabled``)."""

    def __init__(self, actor: Any, cfg: Config) -> None:
        """``actor``: the ``ActorWorker`` whose base this reference is."""
        self.actor, self.cfg = actor, cfg
        self.dims = actor.dims

    def data_coord(self) -> DataCoord:
        """The actor's replica: the reference runs on the actor's view."""
        return self.actor.data_coord()

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob`` (B, R) of the base model (adapters off) at the rollout temperature."""
        engine = self.actor.engine
        with adapters_disabled(engine.module):
            return ref_log_prob(engine, self.cfg, self.dims)(batch)
