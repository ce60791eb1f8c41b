"""Where the parts of a Hugging Face model are: its transformer body and its repeated decoder layers."""

from __future__ import annotations

from torch import nn


def decoder_of(model: nn.Module) -> nn.Module:
    """The transformer body of a Hugging Face model (``model.model`` for Llama-family models)."""
    prefix = getattr(model, "base_model_prefix", "model")
    body = getattr(model, prefix, None)
    if body is None:
        raise TypeError(
            f"{type(model).__name__} has no '{prefix}' body module; it is not a supported HF model"
        )
    return body


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks (the modules FSDP2 shards one by one)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__} (no _no_split_modules)")
    return layers
