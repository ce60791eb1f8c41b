"""Field checks and helpers behind ``Batch``: validation, equality, index resolution, compaction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def _dense_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a compact copy when its storage holds more than its own elements (a slice/view).

    Pickling and ``torch.save`` write a tensor's whole storage, so a chunk of a big batch would otherwise
    carry the entire base buffer. Tensors that own exactly their storage (even transposed or expanded ones,
    whose storage is no larger than the tensor) are left alone.
    """
    if t.layout != torch.strided:
        return t
    if t.untyped_storage().nbytes() > _dense_nbytes(t):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _object_array(values: Sequence[Any]) -> np.ndarray:
    """1-D object array with one element per item (a list of lists stays 1-D, unlike ``np.array``)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _names(keys: str | Sequence[str] | None) -> list[str] | None:
    """A single field name is accepted where a list of names is expected."""
    return [keys] if isinstance(keys, str) else None if keys is None else list(keys)


def _check_tensor(key: str, value: Any) -> torch.Tensor:
    if not isinstance(key, str):
        raise TypeError(f"Batch field names must be str, got {key!r} ({type(key).__name__})")
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"tensors[{key!r}] must be a torch.Tensor, got {type(value).__name__}; "
            "put numpy arrays and lists in non_tensors and per-batch scalars in meta"
        )
    if value.dim() == 0:
        raise ValueError(
            f"tensors[{key!r}] is a 0-dim tensor; batch fields need dim 0 = batch size. "
            f"Put a per-batch scalar in meta ({key!r}: value.item()) or give it shape (batch_size,)"
        )
    return value


def _check_non_tensor(key: str, value: Any) -> np.ndarray:
    if not isinstance(key, str):
        raise TypeError(f"Batch field names must be str, got {key!r} ({type(key).__name__})")
    if isinstance(value, (list, tuple)):
        return _object_array(value)
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"non_tensors[{key!r}] must be a numpy array or a list, got {type(value).__name__}; "
            "put torch tensors in tensors and per-batch scalars in meta"
        )
    if value.ndim == 0:
        raise ValueError(f"non_tensors[{key!r}] is a 0-dim array; put a per-batch scalar in meta instead")
    return value


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    b = b.to(a.device)
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():  # NaN == NaN for the purpose of "same data"
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return False


def _arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "O":  # elements may be dicts, lists or arrays: compare one by one
        return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _values_equal(a: Any, b: Any) -> bool:
    """Equality that works for tensors, arrays, NaNs and values whose ``==`` is not a plain bool."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and _arrays_equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # e.g. dicts holding arrays
        return False


def _merge_meta(metas: Sequence[Mapping[str, Any]], op: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in metas:
        for k, v in m.items():
            if k in out and not _values_equal(out[k], v):
                raise ValueError(
                    f"{op}: meta[{k!r}] differs between batches ({out[k]!r} vs {v!r}); "
                    "make it agree or remove it from one batch's meta first"
                )
            out.setdefault(k, v)
    return out


def _pad_width(t: torch.Tensor, width: int, side: str, value: float) -> torch.Tensor:
    """``t`` padded along dim 1 with ``value`` on ``side`` ('left' or 'right') to ``width`` columns."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    extra = width - t.shape[1]
    if extra == 0:
        return t
    fill = t.new_full((t.shape[0], extra, *t.shape[2:]), value)
    return torch.cat([fill, t] if side == "left" else [t, fill], dim=1)


def _resolve_index(index: Any, n: int) -> slice | np.ndarray:
    """Turn a row index into a forward slice (views) or a 1-D int64 array of non-negative rows (copies)."""
    if isinstance(index, slice):
        if index.step is None or index.step > 0:
            return index
        return np.ascontiguousarray(np.arange(n)[index])  # torch views cannot step backwards
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    elif isinstance(index, Sequence):
        index = np.asarray(index)
    elif not isinstance(index, np.ndarray):
        raise TypeError(
            f"unsupported Batch index type {type(index).__name__}; use a str, int, slice or 1-D index"
        )
    if index.size == 0:
        return np.zeros(0, dtype=np.int64)
    if index.ndim != 1:
        raise ValueError(f"Batch row index must be 1-D, got shape {tuple(index.shape)}")
    if index.dtype == np.bool_:
        if len(index) != n:
            raise ValueError(f"boolean row mask has {len(index)} entries but the batch has {n} rows")
        return np.flatnonzero(index)
    if not np.issubdtype(index.dtype, np.integer):
        raise TypeError(f"Batch row index must hold integers or booleans, got dtype {index.dtype}")
    if index.max() >= n or index.min() < -n:
        raise IndexError(f"row index out of range for a batch of {n} rows: {index.min()}..{index.max()}")
    return np.where(index < 0, index + n, index).astype(np.int64)
