"""Which model a run started from, recorded in every checkpoint and compared when a run resumes.

Resuming continues from trained weights, so the identity is the *initial* model's: the directory
``model.path`` (and ``critic.model.path`` when the critic has its own) as it is on disk, which a run never
changes. It is the model's config (``config.json`` with ``model.override_config`` laid over it, minus
bookkeeping keys such as ``transformers_version``) and a digest of its weights. For safetensors files the
digest is over the tensors (name, dtype, shape and bytes, in name order), so the same weights split into
other shard files digest the same; a model of up to ``FULL_DIGEST_BYTES`` is read whole, a larger one in
``SAMPLES`` evenly spaced blocks of every tensor (a few MB in all: a fine-tune or another seed changes
nearly every element, and reading 15 GB at every resume would not be cheap). Other weight files
(``pytorch_model.bin``) are digested as files the same way.

A LoRA run's checkpoint also records its adapters' settings (rank, alpha, dropout, the adapted linears);
``check_adapters`` refuses resuming them under other settings, naming each key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from hybridflow.checkpoint.sharded import CheckpointError

logger = logging.getLogger(__name__)

FULL_DIGEST_BYTES = 1 << 30  # models up to 1 GiB of weights are hashed whole
SAMPLES = 8  # blocks read from each tensor (or file) of a larger model
BLOCK = 4096
_BOOKKEEPING = {"transformers_version", "use_cache", "torch_dtype", "dtype"}


def model_identity(
    path: str | os.PathLike | None, override_config: Mapping[str, Any] | None = None
) -> dict | None:
    """``{"path", "config", "weights"}`` of the model directory ``path``; None without a local directory."""
    if not path or not Path(path).expanduser().is_dir():
        return None
    root = Path(path).expanduser().resolve()
    return {"path": str(root), "config": model_config(root, override_config), "weights": weights_digest(root)}


def model_config(root: Path, override_config: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """``config.json`` with the overrides laid over it, without the keys that do not change the model."""
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    _lay_over(config, dict(override_config or {}))
    return {k: v for k, v in config.items() if k not in _BOOKKEEPING and not k.startswith("_")}


def _lay_over(config: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(config.get(key), dict):
            _lay_over(config[key], value)
        else:
            config[key] = value


def weights_digest(root: Path) -> str | None:
    """The SHA-256 of the model's weights (tensors of safetensors files, else the files); None if none."""
    files = sorted(root.glob("*.safetensors")) or sorted(root.glob("*.bin"))
    if not files:
        return None
    whole = sum(f.stat().st_size for f in files) <= FULL_DIGEST_BYTES
    h = hashlib.sha256(b"whole" if whole else b"sampled")
    with contextlib.ExitStack() as stack:
        try:
            handles = {f: stack.enter_context(open(f, "rb")) for f in files}
            if files[0].suffix == ".safetensors":
                tensors = sorted(t for f in files for t in _safetensors_tensors(handles[f], f))
                for name, dtype, shape, file, start, end in tensors:
                    digest = _span_digest(handles[file], start, end, whole)
                    h.update(f"{name}|{dtype}|{shape}|{digest}\n".encode())
            else:
                for file, fh in handles.items():
                    h.update(f"{file.name}|{_span_digest(fh, 0, file.stat().st_size, whole)}\n".encode())
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            logger.debug("cannot digest the weights in %s: %s", root, exc)
            return None  # damaged weights: loading the model reports them, naming the file
    return h.hexdigest()


def _safetensors_tensors(fh: BinaryIO, file: Path) -> Iterator[tuple[str, str, str, Path, int, int]]:
    """``(name, dtype, shape, file, start, end)`` of every tensor of a safetensors file (byte offsets)."""
    fh.seek(0)
    (size,) = struct.unpack("<Q", fh.read(8))
    header = json.loads(fh.read(size))
    base = 8 + size
    for name, info in header.items():
        if name != "__metadata__":
            start, end = info["data_offsets"]
            yield name, info["dtype"], str(info["shape"]), file, base + start, base + end


def _span_digest(fh: BinaryIO, start: int, end: int, whole: bool) -> str:
    """SHA-256 of bytes [start, end) of ``fh``: all of them, or ``SAMPLES`` evenly spaced blocks."""
    h = hashlib.sha256()
    length = end - start
    if whole or length <= SAMPLES * BLOCK:
        fh.seek(start)
        remaining = length
        while remaining > 0:
            chunk = fh.read(min(remaining, 8 << 20))
            if not chunk:
                raise ValueError("file shorter than its header says")
            h.update(chunk)
            remaining -= len(chunk)
        return h.hexdigest()
    stride = (length - BLOCK) // (SAMPLES - 1)
    for k in range(SAMPLES):
        fh.seek(start + k * stride)
        h.update(fh.read(BLOCK))
    return h.hexdigest()


def _differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What differs between two identities: config keys (up to three) and the weights."""
    out = []
    a, b = saved.get("config"), current.get("config")
    if a is not None and b is not None and a != b:
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        shown = ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys[:3])
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        out.append(f"config.json differs ({shown}{more})")
    wa, wb = saved.get("weights"), current.get("weights")
    if wa is not None and wb is not None and wa != wb:
        out.append(f"the weights differ (digest {wa[:12]} vs {wb[:12]})")
    return out


def check_identity(ckpt: Path, saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """Refuse a checkpoint trained from another model than this run's, naming both; notice without a record.

    ``saved`` is the checkpoint's record (``meta.json["models"]``), ``current`` this run's, both keyed by
    role ("actor", and "critic" when it has its own directory).
    """
    if saved is None:
        logger.warning(
            "%s does not record which model it was trained from (saved by an earlier version): resuming "
            "without checking that it is this run's model.path",
            ckpt,
        )
        return
    for role, mine in current.items():
        theirs = saved.get(role)
        if theirs is None or mine is None:
            continue
        differ = _differences(theirs, mine)
        if differ:
            key = "model.path" if role == "actor" else f"{role}.model.path"
            raise CheckpointError(
                f"{ckpt} was trained from another model than this run's: its {role} started from "
                f"{theirs['path']}, this run's {key} is {mine['path']}, and {' and '.join(differ)}. Resume "
                f"it with {key}={theirs['path']}, or train {mine['path']} in a new trainer.default_local_dir "
                "(or here from scratch with trainer.resume=disable, whose saves replace these checkpoints)"
            )


# A checkpoint's record of a role's adapters (``workers.rank.lora_record``) -> the config key that sets each
LORA_KEYS = {
    "rank": "model.lora_rank",
    "alpha": "model.lora_alpha",
    "dropout": "model.lora_dropout",
    "target_modules": "model.target_modules",
}


def check_adapters(
    ckpt: Path, role: str, saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None
) -> None:
    """Refuse resuming adapters trained with other LoRA settings (or none) than this run's, naming each key.

    ``saved`` is the checkpoint's record of the role's adapters (``meta.json["roles"][role]["lora"]``),
    ``current`` this run's; None is a role trained without LoRA. Another alpha or rank changes the scale
    alpha / r of what was learned, another dropout what the update sees, other targets which linears it
    adapts: resuming would continue another model than the one trained, without a word.
    """
    theirs = saved if saved is not None else {"rank": 0}
    mine = current if current is not None else {"rank": 0}
    differ = {
        key: (theirs.get(field), mine.get(field))
        for field, key in LORA_KEYS.items()
        if theirs.get(field) != mine.get(field) and (field == "rank" or None not in (saved, current))
    }
    if not differ:
        return
    shown = "; ".join(f"{key} was {a!r} there and is {b!r} here" for key, (a, b) in differ.items())
    back = {key: a for key, (a, _) in differ.items()}
    if current is None:  # this run has no adapters: all the checkpoint's settings, or the defaults trip next
        back = {key: theirs.get(field) for field, key in LORA_KEYS.items()}
    fix = " ".join(f"{key}={_config_value(value)}" for key, value in back.items())
    raise CheckpointError(
        f"{ckpt} was trained with other LoRA settings than this run's ({role}): {shown}. Resume it with "
        f"{fix}, or train with the new settings in a new trainer.default_local_dir (or here from scratch with "
        "trainer.resume=disable, whose saves replace these checkpoints)"
    )


def _config_value(value: Any) -> str:
    """A recorded value as an override writes it (``[self_attn.q_proj,mlp.up_proj]``)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)
