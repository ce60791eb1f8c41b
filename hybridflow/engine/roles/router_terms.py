"""A mixture-of-experts policy's extra update terms: the load-balancing loss and the router's metrics.

Every ``MoEBlock`` keeps its last forward's routing (``models.moe.keep_records``); after a micro-batch's forward
the update reads them here: the auxiliary loss as transformers computes it (``router_aux_loss_coef`` x the
Switch loss over all sparse layers' tokens), ``moe/aux_loss``, ``moe/expert_load_max`` (per layer, the busiest
expert's share of assignments over the mean share, averaged over layers: 1.0 is perfect balance) and, under
router replay, ``moe/router_agreement``: the fraction of the replayed experts that this forward's own router
would also have chosen (rollout against training selection, before replay overrides it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridflow.models.moe import (
    NO_EXPERT,
    RouterRecord,
    keep_records,
    load_balancing_loss,
    moe_blocks,
    records,
)


def aux_loss_coef(setting: float | None, config: Any) -> float:
    """``actor.router_aux_loss_coef``, or where null the model config's ``router_aux_loss_coef`` (0 if none)."""
    if setting is not None:
        return float(setting)
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def _load_max(rec: RouterRecord, keep: torch.Tensor | None, num: int) -> torch.Tensor:
    """One layer's busiest expert's assignments over the mean per expert (1.0: perfectly balanced)."""
    ids = rec.ids if keep is None else rec.ids[keep]  # (n, k)
    counts = torch.zeros(num, device=ids.device).scatter_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), device=ids.device)
    )
    return counts.max() / counts.mean().clamp_min(1e-9)


def _agreement(rec: RouterRecord, keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over replayed tokens of the share of their replayed experts the router chose itself, token count)."""
    assert rec.replay is not None
    replay, own = rec.replay.long(), rec.own  # (N, k)
    valid = (replay != NO_EXPERT).all(-1)  # (N,) tokens the rollout routed
    if keep is not None:
        valid = valid & keep
    same = (own[:, :, None] == replay[:, None, :]).any(-1).float().mean(-1)  # (N,)
    return (same * valid).sum(), valid.sum()


@dataclass
class RouterTerms:
    """The MoE terms of one policy: ``coef`` the auxiliary loss's weight, ``top_k`` and ``num_experts``."""

    coef: float
    top_k: int
    num_experts: int

    @classmethod
    def attach(cls, lm: nn.Module, coef: float) -> RouterTerms:
        """Make ``lm``'s MoE blocks keep their routing and return the terms that read it."""
        keep_records(lm, True)
        spec = moe_blocks(lm)[0].spec
        return cls(coef, spec.top_k, spec.num_experts)

    def of(self, lm: nn.Module, token_mask: torch.Tensor | None) -> tuple[torch.Tensor | None, dict]:
        """(the auxiliary loss or None, metric values) of ``lm``'s last forward; ``token_mask`` (N,) keeps the
        real tokens of a padded micro-batch (None: packed, every row is real)."""
        recs = records(lm)
        if not recs:
            return None, {}
        keep = None if token_mask is None else token_mask.to(recs[0].ids.device).bool()
        aux = load_balancing_loss([r.logits for r in recs], self.top_k, keep)
        loads = torch.stack([_load_max(r, keep, self.num_experts) for r in recs])
        metrics: dict[str, torch.Tensor] = {"moe/aux_loss": aux.detach(), "moe/expert_load_max": loads.mean()}
        replayed = [r for r in recs if r.replay is not None]
        if replayed:
            agree = [_agreement(r, keep) for r in replayed]
            total = sum(n for _, n in agree)
            metrics["moe/router_agreement"] = sum(s for s, _ in agree) / torch.clamp(total, min=1)
        return (aux if self.coef else None), metrics
