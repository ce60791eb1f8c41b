"""The reference policy: a frozen copy of the initial actor, forward only (optionally kept on CPU)."""

from __future__ import annotations

from torch import nn

from hybridflow.config.schema import Config
from hybridflow.engine import ActorEngine, ParallelDims
from hybridflow.protocol import Batch
from hybridflow.utils.dist import init_distributed, world_size
from hybridflow.utils.logging import rank as dist_rank
from hybridflow.workers.dispatch import DataCoord, train_coord


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
        ref = self.cfg.ref
        out = self.engine.compute_log_prob(
            batch,
            temperature=self.cfg.rollout.temperature,
            micro_batch_size=ref.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=ref.log_prob_use_dynamic_bsz,
            max_token_len=self.dims.token_budget(ref.log_prob_max_token_len_per_gpu),
        )
        return Batch({"ref_log_prob": out["log_probs"]})
