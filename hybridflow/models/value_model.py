"""Critic: the policy's backbone with a scalar head (``AutoModelForTokenClassification``, num_labels=1)."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForTokenClassification, PreTrainedModel

from hybridflow.models.loader import from_pretrained_kwargs, load_config

logger = logging.getLogger(__name__)

# Name of the scalar head in transformers' generic token-classification models (Qwen2, Llama, Mistral, the
# MoE families, ...); GPT-2's (and BERT-style models') is ``classifier``.
VALUE_HEAD_NAME = "score"
VALUE_HEAD_NAMES = (VALUE_HEAD_NAME, "classifier")


def value_head_name(model: nn.Module) -> str:
    """The attribute holding ``model``'s token-classification head (``score``, or GPT-2's ``classifier``)."""
    return next(
        (n for n in VALUE_HEAD_NAMES if isinstance(getattr(model, n, None), nn.Linear)), VALUE_HEAD_NAME
    )


def load_value_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
    head_seed: int = 0,
) -> PreTrainedModel:
    """Load a critic from a causal-LM checkpoint (fresh head) or from a saved critic directory.

    A fresh head is initialised by ``init_value_head(model, head_seed)``; the backbone always comes from
    the checkpoint, and a checkpoint that does not cover it raises ValueError instead of silently training
    a randomly initialised critic.
    """
    # Dropout on the value head makes value targets noisy; verl turns it off for the critic as well.
    config = load_config(path, trust_remote_code=trust_remote_code, override_config=override_config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    kwargs = from_pretrained_kwargs(dtype, attn_implementation, trust_remote_code)
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            Path(path).expanduser(), config=config, output_loading_info=True, **kwargs
        )
    except ValueError as err:
        if "Unrecognized configuration class" not in str(err):
            raise
        raise ValueError(
            f"model type {config.model_type!r} at {str(path)!r} has no token-classification class in "
            "transformers, so it cannot carry a value head; use an architecture with "
            "<Arch>ForTokenClassification (Qwen2, Llama, Mistral, ...) or register one with trust_remote_code"
        ) from err
    missing = set(info.get("missing_keys", ()))
    head_keys = {f"{value_head_name(model)}.weight", f"{value_head_name(model)}.bias"}
    if missing - head_keys:
        raise ValueError(
            f"checkpoint at {str(path)!r} does not hold the backbone of {type(model).__name__} "
            f"(missing {sorted(missing - head_keys)[:8]}); pass a causal-LM or critic directory of this model"
        )
    if missing:
        init_value_head(model, seed=head_seed)
        logger.info("critic from causal LM %s: backbone loaded, value head initialised fresh", path)
    else:
        logger.info("critic loaded with its value head from %s", path)
    return model


def value_head(model: PreTrainedModel) -> nn.Linear:
    """Return the scalar head of a critic built by ``load_value_model`` or ``build_value_model``."""
    head = getattr(model, value_head_name(model), None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise TypeError(
            f"{type(model).__name__} has no scalar '{VALUE_HEAD_NAME}' head; load the critic with "
            "load_value_model (AutoModelForTokenClassification with num_labels=1)"
        )
    return head


@torch.no_grad()
def init_value_head(model: PreTrainedModel, seed: int = 0) -> None:
    """Initialise the value head deterministically: weight ~ N(0, 1/(H+1)^2), bias 0.

    The small std (as in OpenRLHF) keeps initial values near zero while the weight still has a
    direction, so the backbone gets gradient from the first step. A private generator keeps the
    global RNG untouched and the result independent of what ran before.
    """
    head = value_head(model)
    hidden = head.in_features
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight = torch.randn(head.weight.shape, generator=gen, dtype=torch.float32) / (hidden + 1)
    head.weight.copy_(weight.to(head.weight.device, head.weight.dtype))
    if head.bias is not None:
        head.bias.zero_()


def build_value_model(causal_lm: PreTrainedModel, head_seed: int = 0) -> PreTrainedModel:
    """Make an in-memory critic from a causal LM: same config, a copy of its backbone, a fresh value head."""
    config = copy.deepcopy(causal_lm.config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    # The throw-away random init must not advance the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        critic = AutoModelForTokenClassification.from_config(
            config, attn_implementation=causal_lm.config._attn_implementation
        )
    param = next(causal_lm.parameters())
    critic.to(device=param.device, dtype=param.dtype)
    prefix = causal_lm.base_model_prefix + "."
    backbone_state = {
        key.removeprefix(prefix): value
        for key, value in causal_lm.state_dict().items()
        if key.startswith(prefix)
    }
    getattr(critic, critic.base_model_prefix).load_state_dict(backbone_state, strict=True)
    init_value_head(critic, seed=head_seed)
    return critic.train(causal_lm.training)


def compute_values(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token values (B, T) in float32 from a critic; positions under a zero mask are not zeroed."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    logits = out.logits  # (B, T, 1)
    if logits.shape[-1] != 1:
        raise ValueError(
            f"model returns {logits.shape[-1]} outputs per token, a critic returns 1; load it with "
            "load_value_model"
        )
    # Value losses and GAE run in float32 even when the critic computes in bf16.
    return logits.squeeze(-1).float()  # (B, T)
