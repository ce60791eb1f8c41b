"""Offline preference updates (DPO / IPO / cDPO and KTO) on the FSDP2 actor engine.

Batches arrive with the rows of a pair (or of an example and its KL partner) adjacent: ``[c0, r0, c1, r1,
...]``, so any split by data-parallel rank or micro-batch of an even size keeps each pair together. Every
loss is a sum over the rank's pairs divided by the global pair count, so the gradient is the same for any
number of ranks or micro-batches. Reference log-probs come in as per-sequence values (``ref_seq_logps``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridflow.algos.preference import dpo_loss, kto_kl_estimate, kto_loss, sequence_logps
from hybridflow.config.preference import PreferenceConfig
from hybridflow.engine.roles.runner import LogProbs
from hybridflow.engine.train.micro_batch import check_batch, fixed_micro_batches
from hybridflow.protocol import Batch

if TYPE_CHECKING:  # for annotations only
    from hybridflow.engine.roles.actor import ActorEngine

PAIR_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "ref_seq_logps")
DPO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def _dpo_micro(
    logp: torch.Tensor, mb: Batch, p: PreferenceConfig, pairs: int, chosen_tokens: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the global DPO loss, and its metric sums."""
    mask = mb["response_mask"].to(logp.device)  # (b, R)
    seq = sequence_logps(logp, mask, average=p.loss_type == "ipo")  # (b,)
    ref = mb["ref_seq_logps"].to(logp.device)  # (b,)
    losses, chosen_r, rejected_r = dpo_loss(
        seq[0::2], seq[1::2], ref[0::2], ref[1::2], p.beta, p.loss_type, p.label_smoothing
    )  # (b/2,) each
    loss = losses.sum() / pairs
    if p.sft_coef > 0:  # mean token NLL of the chosen responses, over all of them in the batch
        loss = loss - p.sft_coef * (logp[0::2] * mask[0::2]).sum() / max(chosen_tokens, 1)
    sums = {
        "rewards/chosen": chosen_r.sum(),
        "rewards/rejected": rejected_r.sum(),
        "rewards/accuracies": (chosen_r > rejected_r).float().sum(),
        "rewards/margins": (chosen_r - rejected_r).sum(),
        "logps/chosen": seq[0::2].detach().sum(),
        "logps/rejected": seq[1::2].detach().sum(),
        "loss": losses.detach().sum(),
    }
    return loss, sums


def _kto_micro(
    logp: torch.Tensor, mb: Batch, p: PreferenceConfig, examples: int, z0: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO on the example rows (even positions); the KL rows were used for ``z0`` already."""
    mask = mb["response_mask"][0::2].to(logp.device)  # (b/2, R)
    seq = sequence_logps(logp[0::2], mask)  # (b/2,)
    ref = mb["ref_seq_logps"][0::2].to(logp.device)
    labels = mb["labels"][0::2].to(logp.device).bool()
    losses, rewards = kto_loss(seq, ref, labels, z0, p.beta, p.desirable_weight, p.undesirable_weight)
    good, bad = labels.float(), (~labels).float()
    sums = {
        "rewards/chosen": (rewards * good).sum(),
        "rewards/rejected": (rewards * bad).sum(),
        "logps/chosen": (seq.detach() * good).sum(),
        "logps/rejected": (seq.detach() * bad).sum(),
        "count/chosen": good.sum(),
        "count/rejected": bad.sum(),
        "loss": losses.detach().sum(),
    }
    return losses.sum() / examples, sums


@torch.no_grad()
def kto_reference_point(engine: ActorEngine, batch: Batch, micro_rows: int) -> torch.Tensor:
    """z0: the policy/reference KL on the mismatched pairs (odd rows), over all ranks, clamped and detached."""
    kl = batch[list(range(1, len(batch), 2))]
    parts = fixed_micro_batches(len(kl), micro_rows)
    (logp,) = engine.runner.forward(kl, parts, LogProbs(fused=engine.fused_head))  # (B, R), on every stage
    total = torch.zeros((), dtype=torch.float64)
    for idx in parts:  # summed per micro-batch, in their order
        seq = sequence_logps(logp[idx], kl["response_mask"][idx].to(logp.device))  # (b,)
        total += (seq.cpu().double() - kl["ref_seq_logps"][idx].double()).sum()
    total, count = engine.dp_sum(total), int(engine.dp_sum(torch.tensor(float(len(kl)))))
    return kto_kl_estimate(total.float().view(1) / max(count, 1), torch.zeros(1))


def update_preference(
    engine: ActorEngine, batch: Batch, p: PreferenceConfig, kind: str, micro_pairs: int
) -> dict[str, float]:
    """One optimizer step of DPO/IPO (``kind="dpo"``) or KTO (``kind="kto"``) over this rank's pairs."""
    check_batch(batch, PAIR_KEYS + (("labels",) if kind == "kto" else ()))
    assert len(batch) % 2 == 0, "pairs come as two adjacent rows"
    engine.engine.onload()
    engine.module.train()
    pairs = int(engine.dp_sum(torch.tensor(float(len(batch) // 2))))
    chosen_tokens = int(engine.dp_sum(batch["response_mask"][0::2].sum().float()))
    z0 = kto_reference_point(engine, batch, 2 * micro_pairs) if kind == "kto" else None
    parts = [
        [2 * i + j for i in idx for j in (0, 1)] for idx in fixed_micro_batches(len(batch) // 2, micro_pairs)
    ]

    def micro_loss(mb: Batch, outs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp = outs[0]  # (b, R)
        if kind == "kto":
            loss, sums = _kto_micro(logp, mb, p, pairs, z0.to(logp.device))
        else:
            loss, sums = _dpo_micro(logp, mb, p, pairs, chosen_tokens)
        # FSDP averages gradients over the data-parallel ranks; the loss is a global sum already
        return loss * engine.engine.dp_size, sums

    summed = engine.backward_micro_batches(batch, parts, micro_loss)  # on every pipeline stage
    metrics = _finish_metrics(summed, pairs, kind)
    if z0 is not None:
        metrics["kl"] = float(z0)
    metrics["actor/grad_norm"] = engine.engine.optimizer_step()
    engine.engine.lr_step()
    engine.engine.offload()
    metrics["actor/lr"] = engine.engine.lr
    return metrics


def _finish_metrics(summed: dict[str, float], pairs: int, kind: str) -> dict[str, float]:
    """Means over the global pairs (DPO) or over each label's examples (KTO), under TRL's names."""
    if kind == "dpo":
        out = {k: summed[k] / pairs for k in DPO_METRICS}
    else:
        good, bad = summed["count/chosen"], summed["count/rejected"]
        out = {
            "rewards/chosen": summed["rewards/chosen"] / good if good else 0.0,
            "rewards/rejected": summed["rewards/rejected"] / bad if bad else 0.0,
            "logps/chosen": summed["logps/chosen"] / good if good else 0.0,
            "logps/rejected": summed["logps/rejected"] / bad if bad else 0.0,
        }
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    out["loss"] = summed["loss"] / pairs
    return out
