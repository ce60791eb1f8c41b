"""Load Hugging Face causal LMs and tokenizers from local directories (no hub access, ever)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# Tokenizer paths whose missing pad token was already reported, so repeated loads stay quiet.
_PAD_DEFAULT_LOGGED: set[str] = set()


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Turn ``"float32" | "bfloat16" | "float16"`` (or fp32/bf16/fp16, or a torch.dtype) into a dtype."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(
                f"dtype must be a floating-point dtype, got {dtype}; use one of {_valid_dtypes()}"
            )
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a string or torch.dtype, got {type(dtype).__name__}")
    key = dtype.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {_valid_dtypes()}")
    return _DTYPES[key]


def _valid_dtypes() -> str:
    return ", ".join(repr(name) for name in _DTYPES)


def resolve_local_dir(path: str | os.PathLike, need: tuple[str, ...] = ("config.json",)) -> Path:
    """Check that ``path`` is a local directory holding one of the files in ``need``; return it."""
    resolved = Path(path).expanduser()
    if not resolved.is_dir():
        raise ValueError(
            f"model path {str(path)!r} is not a local directory. hybridflow never downloads from a model "
            "hub: download the model first (e.g. `huggingface-cli download <name> --local-dir <dir>`) "
            "and pass that directory"
        )
    if not any((resolved / name).is_file() for name in need):
        raise ValueError(
            f"directory {str(path)!r} has none of {list(need)}; pass the directory that a Hugging Face "
            "`save_pretrained` wrote (the one holding config.json and the weights)"
        )
    return resolved


def apply_override_config(config: PretrainedConfig, overrides: dict[str, Any] | None) -> PretrainedConfig:
    """Set ``overrides`` on ``config`` in place; a key the config lacks raises ValueError.

    A dict value merges into a dict or sub-config attribute. ``rope_theta`` also reaches
    ``rope_parameters["rope_theta"]``, where transformers 5 keeps it.
    """
    if not overrides:
        return config
    if not isinstance(overrides, dict):
        raise TypeError(f"override_config must be a dict, got {type(overrides).__name__}")
    for key, value in overrides.items():
        _override_one(config, key, value, prefix="")
    return config


def _override_one(config: PretrainedConfig, key: str, value: Any, prefix: str) -> None:
    rope = getattr(config, "rope_parameters", None)
    if not hasattr(config, key):
        if isinstance(rope, dict) and key in rope:
            rope[key] = value
            return
        raise ValueError(
            f"override_config key {prefix + key!r} is not a field of the {type(config).__name__} "
            f"(model_type={getattr(config, 'model_type', '?')!r}); check the spelling against the model's "
            "config.json"
        )
    current = getattr(config, key)
    if isinstance(value, dict) and isinstance(current, PretrainedConfig):
        for sub_key, sub_value in value.items():
            _override_one(current, sub_key, sub_value, prefix=f"{prefix}{key}.")
    elif isinstance(value, dict) and isinstance(current, dict):
        current.update(value)
    else:
        setattr(config, key, value)


def load_config(
    path: str | os.PathLike,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
    **kwargs: Any,
) -> PretrainedConfig:
    """Load a model config from a local directory and apply ``override_config``."""
    model_dir = resolve_local_dir(path)
    config = AutoConfig.from_pretrained(
        model_dir, trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
    )
    return apply_override_config(config, override_config)


def from_pretrained_kwargs(
    dtype: str | torch.dtype, attn_implementation: str | None, trust_remote_code: bool
) -> dict[str, Any]:
    """Keyword arguments shared by every ``from_pretrained`` call of this package."""
    # transformers renamed `torch_dtype` to `dtype` in 4.56; accept both generations.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    kwargs: dict[str, Any] = {
        dtype_key: resolve_dtype(dtype),
        "trust_remote_code": trust_remote_code,
        "local_files_only": True,
    }
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


def load_causal_lm(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """Load a causal LM (any architecture ``AutoModelForCausalLM`` knows) from a local directory."""
    config = load_config(path, trust_remote_code=trust_remote_code, override_config=override_config)
    kwargs = from_pretrained_kwargs(dtype, attn_implementation, trust_remote_code)
    model, info = AutoModelForCausalLM.from_pretrained(
        Path(path).expanduser(), config=config, output_loading_info=True, **kwargs
    )
    if info.get("missing_keys"):
        # transformers does not list tied weights here, so every missing key was randomly initialised.
        logger.warning(
            "weights missing from %s (randomly initialised): %s", path, sorted(info["missing_keys"])
        )
    logger.info(
        "loaded %s from %s: dtype=%s, attn=%s, %.1fM parameters",
        type(model).__name__,
        path,
        model.dtype,
        model.config._attn_implementation,
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model


def load_tokenizer(
    path: str | os.PathLike, trust_remote_code: bool = False, **kwargs: Any
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local directory; one without a pad token gets pad = eos."""
    tok_dir = resolve_local_dir(path, need=("tokenizer_config.json", "tokenizer.json", "config.json"))
    tokenizer = AutoTokenizer.from_pretrained(
        tok_dir, trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
    )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer at {str(path)!r} has neither a pad nor an eos token; pass one explicitly, "
                "e.g. load_tokenizer(path, pad_token='<pad>')"
            )
        tokenizer.pad_token = tokenizer.eos_token
        key = str(tok_dir.resolve())
        if key not in _PAD_DEFAULT_LOGGED:
            _PAD_DEFAULT_LOGGED.add(key)
            logger.warning("tokenizer at %s has no pad token; using eos %r as pad", path, tokenizer.eos_token)
    return tokenizer
