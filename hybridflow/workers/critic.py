"""The critic role: a value model trained on the returns."""

from __future__ import annotations

from torch import nn

from hybridflow.config.schema import Config
from hybridflow.engine.critic import CriticEngine
from hybridflow.protocol import Batch


class CriticWorker:
    """``compute_values`` before the update and ``update_critic`` after the advantages."""

    def __init__(self, value_model: nn.Module, cfg: Config, total_steps: int) -> None:
        c = cfg.critic
        self.engine = CriticEngine(
            value_model,
            c,
            ppo_mini_batch_size=c.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size,
            rollout_n=cfg.rollout.n,
            use_remove_padding=c.model.use_remove_padding,
            gradient_checkpointing=c.model.enable_gradient_checkpointing,
            total_steps=total_steps,
        )

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` (B, R)."""
        return Batch({"values": self.engine.compute_values(batch)})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Value-loss update; verl-named metrics."""
        return self.engine.update_critic(batch)
