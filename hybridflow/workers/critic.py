"""The critic role: a value model trained on the returns."""

from __future__ import annotations

from torch import nn

from hybridflow.config.schema import Config
from hybridflow.engine import CriticEngine, ParallelDims
from hybridflow.protocol import Batch
from hybridflow.utils.dist import init_distributed, world_size
from hybridflow.utils.logging import rank as dist_rank
from hybridflow.workers.dispatch import DataCoord, train_coord


class CriticWorker:
    """``compute_values`` before the update and ``update_critic`` after the advantages."""

    def __init__(self, value_model: nn.Module, cfg: Config, total_steps: int, pad_token_id: int = 0) -> None:
        c = cfg.critic
        init_distributed()
        dims = ParallelDims.of(cfg, "critic", world_size(), dist_rank())
        dims.check_model(value_model.config)
        self.engine = CriticEngine(
            value_model,
            dims.budgets(c),  # a token budget per replica
            ppo_mini_batch_size=c.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size,
            rollout_n=cfg.rollout.n,
            use_remove_padding=c.model.use_remove_padding,
            gradient_checkpointing=c.model.enable_gradient_checkpointing,
            total_steps=total_steps,
            dims=dims,
        )
        self.dims = self.engine.dims  # with its process groups

    def data_coord(self) -> DataCoord:
        """This rank's model replica in the critic's view: the driver hands its ranks one share of a batch."""
        return train_coord(self.dims, dist_rank())

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` (B, R)."""
        return Batch({"values": self.engine.compute_values(batch)})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Value-loss update; verl-named metrics."""
        return self.engine.update_critic(batch)
