"""Training a vision-language model (Qwen2-VL / Qwen2.5-VL): its vision tower, its processor, what is refused.

The tower (``model.model.visual``: patch embedding, blocks, and the ``merger`` that turns 2 x 2 patches into
one token of the language model's width) is frozen by default (``model.freeze_vision_tower``): its
parameters get ``requires_grad=False``, so they receive no gradient, the optimizer never sees them and the
hybrid switch can skip resending them after the first time. ``VisionSpec`` is what the training forward
needs to know of a model to feed it images: the image token, the merge size and a patch's width.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from hybridflow.config.parallel import role_sizes
from hybridflow.models.vision import VisionProcessor, is_vision_language
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VisionSpec:
    """What a training forward needs to know of a VLM to feed it images."""

    image_token_id: int
    merge_size: int  # patches merged per side into one language-model token
    patch_dim: int  # width of one row of ``pixel_values``: channels x temporal patch x patch x patch

    @property
    def dummy_grid(self) -> tuple[int, int, int]:
        """The smallest image grid the tower takes (t, h, w): one merged token."""
        return (1, self.merge_size, self.merge_size)


def vision_spec(config: Any) -> VisionSpec | None:
    """The ``VisionSpec`` of a model config, None for a text model."""
    if not is_vision_language(config):
        return None
    vision = config.vision_config
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3)
    patch_dim = channels * vision.temporal_patch_size * vision.patch_size * vision.patch_size
    return VisionSpec(int(config.image_token_id), int(vision.spatial_merge_size), int(patch_dim))


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision tower (with its merger) of a Qwen2-VL-family model, None for a text model."""
    if not is_vision_language(getattr(model, "config", None)):
        return None
    return model.model.visual


def is_vision_param(name: str) -> bool:
    """Whether a parameter name (under any wrapper's prefix) is the vision tower's, merger included."""
    return ".visual." in f".{name}"


def vision_units(model: nn.Module) -> list[nn.Module]:
    """The tower's modules FSDP2 shards one by one: each block, the merger, then the tower (patch embedding)."""
    tower = vision_tower(model)
    return [] if tower is None else [*tower.blocks, tower.merger, tower]


def set_vision_trainable(model: nn.Module, trainable: bool) -> int:
    """Set ``requires_grad`` on the vision tower's parameters (the merger included); returns how many."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    params = list(tower.parameters())
    for param in params:
        param.requires_grad_(trainable)
    logger.info(
        "vision tower %s: %.2fM parameters",
        "trained" if trainable else "frozen",
        sum(p.numel() for p in params) / 1e6,
    )
    return len(params)


def load_vision_processor(
    path: str | os.PathLike | None, tokenizer: Any, config: Any
) -> VisionProcessor | None:
    """The processor of a VLM's directory (its image processor beside ``tokenizer``); None for a text model."""
    if path is None or not is_vision_language(config):
        return None
    if not (Path(path).expanduser() / "preprocessor_config.json").is_file():
        raise UserError(
            f"model.path={path} is a vision-language model ({config.model_type}) without "
            "preprocessor_config.json (the image processor's settings); copy the model's processor files "
            "into it"
        )
    return VisionProcessor.from_pretrained(Path(path).expanduser(), tokenizer)


def check_vision_training(cfg: Any, config: Any, command: str = "train") -> None:
    """Refuse, naming the setting, what training a VLM does not implement (a text model passes)."""
    if not is_vision_language(config):
        return
    kind = f"a vision-language model ({config.model_type})"
    if command not in ("train", "sft"):  # SFT takes image rows (with the processor) and text rows alike
        raise UserError(
            f"`hybridflow {command}` with {kind} is not implemented (its datasets carry no images); "
            "train it with `hybridflow train` (GRPO/PPO on image prompts), or point model.path to a text model"
        )
    for role in ("actor", "ref"):
        for dim, size in role_sizes(cfg, role).items():
            if size not in (None, 1):
                raise UserError(
                    f"{role}.parallel.{dim}={size} with {kind}: its training runs on FSDP2 only so far; "
                    f"set {role}.parallel.{dim}=1"
                )
    if cfg.use_critic:
        raise UserError(
            f"a critic (critic.enable, or algorithm.adv_estimator=gae) with {kind} is not implemented; "
            "use a critic-free estimator (algorithm.adv_estimator=grpo, rloo, ...) and critic.enable=false"
        )
    if cfg.model.lora_rank > 0:
        raise UserError(
            f"model.lora_rank={cfg.model.lora_rank} with {kind} is not implemented; set model.lora_rank=0"
        )
