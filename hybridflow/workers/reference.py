"""The reference policy: a frozen copy of the initial actor, forward only (optionally kept on CPU)."""

from __future__ import annotations

from torch import nn

from hybridflow.config.schema import Config
from hybridflow.config.sequence_parallel import sequence_parallel_size
from hybridflow.config.views import train_view_sizes
from hybridflow.engine import ActorEngine, TrainView, check_train_tp, group_budgets
from hybridflow.protocol import Batch
from hybridflow.utils.dist import init_distributed, world_size
from hybridflow.utils.logging import rank as dist_rank
from hybridflow.workers.dispatch import DataCoord, train_coord


class ReferenceWorker:
    """Log-probs of the responses under the reference weights (``ref_log_prob``)."""

    def __init__(self, model: nn.Module, cfg: Config, pad_token_id: int = 0) -> None:
        self.cfg = cfg
        init_distributed()
        sp = sequence_parallel_size(cfg, "ref")
        view = TrainView(world_size(), *train_view_sizes(cfg, "ref"), "ref", sp=sp)
        if view.tp > 1:
            check_train_tp(model.config, view.tp, "ref")
        self.engine = ActorEngine(
            model,
            group_budgets(cfg.actor, view.sp),
            rollout_n=cfg.rollout.n,
            use_remove_padding=cfg.model.use_remove_padding,
            trainable=False,
            fsdp=cfg.ref.fsdp,
            view=view,
        )

    def data_coord(self) -> DataCoord:
        """This rank's model replica in the reference's view: the driver hands its ranks one share of a batch."""
        return train_coord(self.engine.engine.view, dist_rank())

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob`` (B, R) at the rollout temperature."""
        ref = self.cfg.ref
        out = self.engine.compute_log_prob(
            batch,
            temperature=self.cfg.rollout.temperature,
            micro_batch_size=ref.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=ref.log_prob_use_dynamic_bsz,
            max_token_len=ref.log_prob_max_token_len_per_gpu * self.engine.engine.view.sp,
        )
        return Batch({"ref_log_prob": out["log_probs"]})
