"""The ``preference`` section: offline preference training (DPO, IPO, cDPO and KTO)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.schema_base import option


@dataclass
class PreferenceConfig:
    """Losses and dataset columns of ``hybridflow dpo`` / ``hybridflow kto``."""

    loss_type: str = option("sigmoid", "DPO loss: sigmoid (DPO; cDPO with label_smoothing > 0) or ipo.")
    beta: float = option(0.1, "Strength of the KL constraint to the reference (DPO/IPO/KTO beta).")
    label_smoothing: float = option(0.0, "cDPO: probability that a preference label is flipped, in [0, 0.5).")
    sft_coef: float = option(0.0, "Weight of an SFT (mean token NLL) term on the chosen responses.")
    desirable_weight: float = option(1.0, "KTO: weight of the desirable (label true) examples.")
    undesirable_weight: float = option(1.0, "KTO: weight of the undesirable (label false) examples.")
    chosen_key: str = option("chosen", "Dataset column of the preferred response (DPO).")
    rejected_key: str = option("rejected", "Dataset column of the dispreferred response (DPO).")
    completion_key: str = option("completion", "Dataset column of the completion (KTO).")
    label_key: str = option("label", "Dataset column of the bool label (KTO).")
    truncation: str = option(
        "filter", "Over-long rows: filter (drop and count), left/right (cut the prompt), or error."
    )
