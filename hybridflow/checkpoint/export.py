"""Export a checkpoint's actor (or critic) as a Hugging Face model directory: the model merger.

The checkpoint keeps, next to each role's shards, the model's config, generation config and tokenizer
(``{role}/hf_config``). Export rebuilds the architecture from that config, reads the full tensors out of the
shards in one process (whatever world size saved them) and writes safetensors with ``save_pretrained``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridflow.checkpoint.identity import weights_digest
from hybridflow.checkpoint.manager import HF_CONFIG, SHARDS, verify_checkpoint
from hybridflow.checkpoint.sharded import CheckpointError, check_shapes, load_full_state
from hybridflow.models.adapters import is_adapter_name, merge_adapter_state, write_peft_adapter
from hybridflow.models.loader import resolve_dtype
from hybridflow.models.vision import is_vision_language
from hybridflow.utils.errors import UserError
from hybridflow.utils.storage import staged_dir

logger = logging.getLogger(__name__)

EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")


def write_hf_config(out_dir: Path, model: nn.Module, tokenizer: Any | None) -> None:
    """Save what export needs besides the weights: config, generation config, tokenizer (a vision-language
    model's processor in its place: the image processor's files and the tokenizer's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def save_hf_model(
    state: dict[str, torch.Tensor],
    config: Any,
    tokenizer: Any | None,
    out_dir: str | os.PathLike,
    prefix: str = "",
    base: nn.Module | None = None,
    staged: bool = True,
    what: str = "the model",
    generation_config: Any | None = None,
) -> Path:
    """Write a full state dict (keys under ``prefix``) as a causal-LM Hugging Face directory with its tokenizer.

    ``base`` is a module of the architecture to receive the weights; None writes ``state``'s tensors as they
    are, through a model on the meta device: no second host copy of the weights and no random init (a 7B
    model's 30 GB, and minutes of init, on a host that already holds its masters and moments).
    ``staged=False``: ``out_dir`` is the caller's own staging directory (SFT's, beside its metrics), written
    into directly; otherwise the model is written beside ``out_dir`` and replaces it whole when complete (a
    full disk is a ``DiskFullError`` naming ``what``, and an earlier ``out_dir`` stays as it was).
    ``generation_config``: the trained model's own (its stop tokens: a chat model's end-of-turn); None keeps the
    one ``base`` carries, or for the meta model the one derived from ``config`` (the config's eos alone).
    """
    needed = _bytes(state.values())
    state = {k.removeprefix(prefix): v for k, v in state.items()}
    if base is not None:
        base.load_state_dict(state, strict=True)
        state = None  # save_pretrained takes the module's own
    else:
        base = _meta_model(config)
        state = _checked_state(base, state)
    if generation_config is not None:
        base.generation_config = copy.deepcopy(generation_config)
    out = Path(out_dir)
    # written beside and renamed: a kill never leaves a half model
    with staged_dir(out, what, needed) if staged else contextlib.nullcontext(out) as into:
        base.save_pretrained(into, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(into)
    return out


def _bytes(tensors: Any) -> int:
    """What ``tensors`` take on disk (about: safetensors adds a small header)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def auto_class(config: Any, role: str = "actor") -> type:
    """The transformers auto class that builds ``role``'s architecture: a causal LM, a vision-language model
    (vision tower included) or the critic's token classifier."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    if role == "critic":
        return AutoModelForTokenClassification
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def _meta_model(config: Any) -> nn.Module:
    """The causal-LM architecture of ``config`` with no storage (what ``save_pretrained`` needs of a module)."""
    with torch.device("meta"):
        return auto_class(config).from_config(config)


def _checked_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the names of tied weights (written once, as ``save_pretrained`` of the module would),
    after checking that it holds exactly ``model``'s keys (what a strict ``load_state_dict`` checks)."""
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"the state does not match {type(model).__name__}: missing {missing}, unexpected {unexpected}"
        )
    first = {name for name, _ in model.named_parameters()}
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - first
    return {k: v for k, v in state.items() if k not in aliases}


def _build(config_dir: Path, role: str) -> nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(config_dir)
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten: keep the caller's RNG
        return auto_class(config, role).from_config(config)


def _export_dtype(name: str, model: nn.Module) -> torch.dtype:
    if name not in EXPORT_DTYPES:
        raise UserError(f"unknown export dtype {name!r}; choose one of {', '.join(EXPORT_DTYPES)}")
    if name != "auto":
        return resolve_dtype(name)
    saved = getattr(model.config, "dtype", None)
    return resolve_dtype(saved) if saved is not None else torch.float32


def load_role_model(ckpt_dir: str | os.PathLike, role: str = "actor") -> nn.Module:
    """The role's model as a plain (unsharded, float32) Hugging Face module with the checkpoint's weights.

    The checkpoint's files are verified against their checksums first: a damaged one is refused.
    """
    ckpt = Path(ckpt_dir)
    meta = verify_checkpoint(ckpt)
    if role not in meta["roles"]:
        raise CheckpointError(f"checkpoint {ckpt} has no {role}; it holds {', '.join(sorted(meta['roles']))}")
    config_dir = ckpt / role / HF_CONFIG
    if not (config_dir / "config.json").is_file():
        raise CheckpointError(f"{config_dir}/config.json is missing: the checkpoint cannot be exported")
    lora = meta["roles"][role].get("lora")
    if lora is not None:  # adapters only: the base comes from the model the run started from
        model, adapters = load_adapted(ckpt, meta, role)
        state = merge_adapter_state(model.state_dict() | adapters, lora["alpha"] / lora["rank"])
        model.load_state_dict(state, strict=True)
        return model
    model = _build(config_dir, role).float()
    prefix = meta["roles"][role].get("prefix", "")
    shapes = {f"{prefix}{name}": list(p.shape) for name, p in model.named_parameters()}
    check_shapes(meta["roles"][role]["shapes"], shapes, f"the {role} in {ckpt}")
    # The state dict names tied weights under both names, as the shards were saved.
    state = load_full_state(ckpt / role / SHARDS, {f"{prefix}{k}": v for k, v in model.state_dict().items()})
    model.load_state_dict({k.removeprefix(prefix): v for k, v in state.items()}, strict=True)
    return model


def base_path(ckpt: Path, meta: dict[str, Any], role: str) -> Path:
    """The base model directory a LoRA checkpoint was trained on, checked against the recorded weights."""
    record = meta.get("models", {}).get(role)
    if record is None:
        raise CheckpointError(f"{ckpt} holds {role} adapters but does not record the base model they adapt")
    path = Path(record["path"])
    digest = weights_digest(path) if path.is_dir() else None
    if digest is None or (record.get("weights") is not None and digest != record["weights"]):
        found = "is missing" if digest is None else "holds other weights"
        raise CheckpointError(
            f"{ckpt} holds {role} adapters of the base model {path}, which {found} now; put that model "
            "back at its path (the adapters alone are not the model)"
        )
    return path


def load_adapted(ckpt: Path, meta: dict[str, Any], role: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The base model (float32, from the recorded path, with the checkpoint's config) and the adapters'
    whole tensors (plain HF names) of a LoRA checkpoint."""
    from transformers import AutoConfig

    path = base_path(ckpt, meta, role)
    config = AutoConfig.from_pretrained(ckpt / role / HF_CONFIG)
    model = auto_class(config, role).from_pretrained(path, config=config, dtype=torch.float32)
    saved = meta["roles"][role]
    prefix = saved.get("prefix", "")
    template = {
        name: torch.empty(shape, dtype=torch.float32)
        for name, shape in saved["shapes"].items()
        if is_adapter_name(name)
    }
    adapters = load_full_state(ckpt / role / SHARDS, template)
    return model, {k.removeprefix(prefix): v for k, v in adapters.items()}


def export_adapter(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, role: str = "actor") -> Path:
    """Write a LoRA checkpoint's adapters in PEFT's format (``adapter_config.json`` and
    ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, dir)`` loads)."""
    ckpt, out = Path(ckpt_dir), Path(out_dir)
    meta = verify_checkpoint(ckpt)
    lora = meta["roles"].get(role, {}).get("lora")
    if lora is None:
        raise UserError(f"{ckpt}'s {role} was trained without LoRA: export it without --adapter-only")
    _, adapters = load_adapted(ckpt, meta, role)
    with staged_dir(out, f"the {role} adapters", _bytes(adapters.values())) as staged:
        write_peft_adapter(staged, adapters, lora, str(base_path(ckpt, meta, role)))
    logger.debug("exported the %s adapters of %s to %s (PEFT format)", role, ckpt, out)  # the CLI says it
    return out


def export_hf(
    ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, role: str = "actor", dtype: str = "auto"
) -> Path:
    """Write the role's weights, config, generation config and tokenizer as a Hugging Face model directory
    (a vision-language model's whole model, vision tower included, and its image processor's files)."""
    ckpt, out = Path(ckpt_dir), Path(out_dir)
    model = load_role_model(ckpt, role)
    model.to(_export_dtype(dtype, model))
    config_dir = ckpt / role / HF_CONFIG
    # written beside and renamed into place when complete; a full disk leaves an earlier export as it was
    with staged_dir(out, f"the exported {role}", _bytes(model.parameters())) as staged:
        model.save_pretrained(staged, safe_serialization=True)
        for path in config_dir.iterdir():  # tokenizer files and generation config, as saved
            if path.name != "config.json" and path.is_file():
                shutil.copy2(path, staged / path.name)
    logger.debug("exported the %s of %s to %s", role, ckpt, out)  # the CLI says it (once)
    return out
