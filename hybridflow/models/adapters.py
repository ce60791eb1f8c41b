"""LoRA adapters as state dicts: merged into the base's weights, or written in PEFT's format.

The training module names an adapter ``{linear}.lora_A.weight`` (r, in) and ``{linear}.lora_B.weight``
(out, r) beside the base's ``{linear}.weight`` (``engine.parallel.lora``). PEFT saves the same tensors as
``base_model.model.{linear}.lora_A.weight`` in ``adapter_model.safetensors`` beside an ``adapter_config.json``,
which ``peft.PeftModel.from_pretrained(base, dir)`` loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

ADAPTER_PARTS = ("lora_A", "lora_B")
PEFT_PREFIX = "base_model.model."


def is_adapter_name(name: str) -> bool:
    """Whether the parameter ``name`` belongs to an adapter (``...lora_A.weight``, ``...lora_B.weight``)."""
    return any(p in ADAPTER_PARTS for p in name.split("."))


def merge_adapter_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """``state`` with every adapter merged: W + scaling * B A under W's name, in W's dtype, rounded once; the
    adapters' keys dropped (plain Hugging Face names)."""
    out = {k: v for k, v in state.items() if not is_adapter_name(k)}
    for key in state:
        if key.endswith(".lora_A.weight"):
            stem = key.removesuffix(".lora_A.weight")
            w = out[f"{stem}.weight"]
            a, b = state[key].float(), state[f"{stem}.lora_B.weight"].float()  # (r, in), (out, r)
            out[f"{stem}.weight"] = torch.addmm(w.float(), b.to(w.device), a.to(w.device), alpha=scaling).to(
                w.dtype
            )
    return out


def target_suffixes(names: list[str]) -> list[str]:
    """The layer-relative names of the adapted linears (``self_attn.q_proj``) from adapter parameter names."""
    out: dict[str, None] = {}
    for name in names:
        if name.endswith(".lora_A.weight"):
            stem = name.removesuffix(".lora_A.weight").split(".")
            idx = next((i for i, p in enumerate(stem) if p.isdigit()), -1)
            out.setdefault(".".join(stem[idx + 1 :]), None)
    return list(out)


def peft_config(lora: dict[str, Any], base_path: str | None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for the adapters described by ``lora`` (a checkpoint's record)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]),
        "lora_dropout": float(lora["dropout"]),
        "target_modules": list(lora["target_modules"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def write_peft_adapter(
    out_dir: str | os.PathLike, adapters: dict[str, torch.Tensor], lora: dict[str, Any], base_path: str | None
) -> Path:
    """Write ``adapters`` (plain HF module names) as a PEFT adapter directory into ``out_dir``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + k: v.detach().contiguous() for k, v in adapters.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(lora, base_path), indent=2) + "\n")
    return out
