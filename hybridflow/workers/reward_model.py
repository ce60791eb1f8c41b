"""The reward-model role: a sequence-classification checkpoint that scores (prompt + response)."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForSequenceClassification

from hybridflow.config.schema import Config
from hybridflow.engine import decoder_of, default_device, move_model, to_dtype
from hybridflow.models.loader import resolve_local_dir
from hybridflow.protocol import Batch
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)


class RewardModelWorker:
    """Scores each sample with the reward model's head at the sample's last real token.

    The reward model must share the policy's tokenizer (its inputs are the policy's token ids); a
    vocabulary of another size is refused when the worker is built.
    """

    def __init__(self, cfg: Config, policy_vocab_size: int) -> None:
        rm = cfg.reward.model
        if not rm.path:
            raise UserError("reward.model.enable is true but reward.model.path is not set")
        path = resolve_local_dir(rm.path)
        self.device = default_device()
        dtype = to_dtype("bfloat16" if self.device.type == "cuda" else "float32")
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, trust_remote_code=rm.trust_remote_code, local_files_only=True
        ).eval()
        if self.model.config.num_labels != 1:
            raise UserError(
                f"reward model {rm.path} has num_labels={self.model.config.num_labels}; a reward "
                "model has a single scalar output (num_labels=1)"
            )
        if self.model.config.vocab_size != policy_vocab_size:
            raise UserError(
                f"reward model {rm.path} has a vocabulary of {self.model.config.vocab_size} tokens, "
                f"the policy {policy_vocab_size}; the reward model must use the policy's tokenizer"
            )
        self.offload = rm.param_offload
        self.micro_batch_size = rm.micro_batch_size_per_gpu
        move_model(self.model, "cpu" if self.offload else self.device)

    @torch.no_grad()
    def compute_scores(self, batch: Batch) -> torch.Tensor:
        """One float score per sample (B,), on CPU."""
        move_model(self.model, self.device)
        scores = []
        for start in range(0, len(batch), self.micro_batch_size):
            ids = batch["input_ids"][start : start + self.micro_batch_size].to(self.device)  # (b, T)
            mask = batch["attention_mask"][start : start + self.micro_batch_size].to(self.device)  # (b, T)
            hidden = decoder_of(self.model)(
                input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
            ).last_hidden_state
            last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # (b,) index of each row's last real token
            rows = hidden[torch.arange(len(ids), device=self.device), last]  # (b, H)
            scores.append(self.model.score(rows).float().squeeze(-1).cpu())
        if self.offload:
            move_model(self.model, "cpu")  # through pinned memory, like the trained roles
        return torch.cat(scores)
