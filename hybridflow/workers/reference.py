"""The reference policy: a frozen copy of the initial actor, forward only (optionally kept on CPU)."""

from __future__ import annotations

from torch import nn

from hybridflow.config.schema import Config
from hybridflow.engine.actor import ActorEngine
from hybridflow.protocol import Batch


class ReferenceWorker:
    """Log-probs of the responses under the reference weights (``ref_log_prob``)."""

    def __init__(self, model: nn.Module, cfg: Config) -> None:
        self.cfg = cfg
        self.engine = ActorEngine(
            model,
            cfg.actor,
            rollout_n=cfg.rollout.n,
            use_remove_padding=cfg.model.use_remove_padding,
            trainable=False,
            fsdp=cfg.ref.fsdp,
        )

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob`` (B, R) at the rollout temperature."""
        ref = self.cfg.ref
        out = self.engine.compute_log_prob(
            batch,
            temperature=self.cfg.rollout.temperature,
            micro_batch_size=ref.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=ref.log_prob_use_dynamic_bsz,
            max_token_len=ref.log_prob_max_token_len_per_gpu,
        )
        return Batch({"ref_log_prob": out["log_probs"]})
