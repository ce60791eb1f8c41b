"""``Batch``: the unit of data between the driver and the workers (verl's DataProto idea, no tensordict).

A batch is three dicts: ``tensors`` (torch tensors sharing dim 0, the batch size), ``non_tensors`` (numpy
arrays, usually ``dtype=object``, of the same length: uids, data sources, raw prompts) and ``meta`` (plain
values about the whole batch: temperature, global step). A field name lives in ``tensors`` or in
``non_tensors``, never both, so ``batch["name"]`` is unambiguous.

Operations return new ``Batch`` objects that share tensor memory where they can (slices are views, gathers
copy). The in-place operations are ``reorder``, ``pop``, ``drop`` and item assignment.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.protocol.fields import (
    _arrays_equal,
    _check_non_tensor,
    _check_tensor,
    _compact,
    _dense_nbytes,
    _merge_meta,
    _names,
    _object_array,
    _pad_width,
    _resolve_index,
    _tensors_equal,
)

# Row index accepted by ``Batch.__getitem__`` (a string index returns a field instead).
Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor
# How ``Batch.concat`` may widen a tensor field along dim 1: field -> (side 'left' | 'right', fill value).
Padding = Mapping[str, tuple[str, float]]

_SAVE_FORMAT = "hybridflow.Batch/1"


class Batch:
    """Tensors sharing dim 0, numpy non-tensor fields of the same length, and a ``meta`` dict."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        self.tensors: dict[str, torch.Tensor] = {k: _check_tensor(k, v) for k, v in (tensors or {}).items()}
        self.non_tensors: dict[str, np.ndarray] = {
            k: _check_non_tensor(k, v) for k, v in (non_tensors or {}).items()
        }
        self.meta: dict[str, Any] = dict(meta or {})
        both = sorted(set(self.tensors) & set(self.non_tensors))
        if both:
            raise ValueError(f"fields {both} are in both tensors and non_tensors; a name must be in only one")
        ref: tuple[str, int] | None = None
        for name, _, rows in self._row_counts():
            if ref is None:
                ref = (name, rows)
            elif rows != ref[1]:
                raise ValueError(
                    f"{name} has {rows} rows but {ref[0]} has {ref[1]}; "
                    "every field must share dim 0 (the batch size)"
                )

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor],
        non_tensors: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Build a validated batch (verl's ``DataProto.from_dict``)."""
        return cls(tensors, non_tensors, meta)

    @classmethod
    def _new(cls, tensors: dict, non_tensors: dict, meta: dict) -> Batch:
        """Internal constructor without validation, for results of operations on valid batches."""
        out = cls.__new__(cls)
        out.tensors, out.non_tensors, out.meta = tensors, non_tensors, dict(meta)
        return out

    def _row_counts(self) -> Iterator[tuple[str, str, int]]:
        """(display name, key, rows) of every field."""
        for k, t in self.tensors.items():
            yield f"tensors[{k!r}]", k, t.shape[0]
        for k, a in self.non_tensors.items():
            yield f"non_tensors[{k!r}]", k, a.shape[0]

    # ---- size and field access ------------------------------------------------------------------------

    def __len__(self) -> int:
        for _, _, rows in self._row_counts():
            return rows
        return 0  # no fields at all

    @property
    def batch_size(self) -> int:
        """Number of rows (0 for a batch without fields)."""
        return len(self)

    def keys(self) -> list[str]:
        """All field names: tensor keys first, then non-tensor keys."""
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def get(self, key: str, default: Any = None) -> Any:
        """The tensor or non-tensor field ``key``, or ``default`` when the batch has no such field."""
        return self[key] if key in self else default  # noqa: SIM401 (this is get itself)

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("Batch is not iterable; use batch.keys() for field names or batch.split(1) for rows")

    def nbytes(self) -> int:
        """Total bytes of the tensor fields' elements (a view counts its own elements, not its base)."""
        return sum(_dense_nbytes(t) for t in self.tensors.values())

    def _missing(self, keys: Sequence[str], where: Mapping[str, Any], kind: str) -> None:
        absent = [k for k in keys if k not in where]
        if absent:
            raise KeyError(f"{kind} {absent} not in batch; it has {kind} {list(where)}")

    def __getitem__(self, index: str | Index) -> Any:
        """``batch["key"]`` returns the field; any row index returns a new Batch (an int: 1 row, kept 2-D)."""
        if isinstance(index, str):
            if index in self.tensors:
                return self.tensors[index]
            if index in self.non_tensors:
                return self.non_tensors[index]
            raise KeyError(f"{index!r} not in batch; fields are {self.keys()}")
        if isinstance(index, torch.Tensor) and index.dim() == 0:
            index = index.item()
        if isinstance(index, (bool, np.bool_)):
            raise TypeError("a bare bool is not a row index; use a boolean mask with one entry per row")
        if isinstance(index, (int, np.integer)):
            n = len(self)
            if not -n <= index < n:
                raise IndexError(f"row {index} out of range for a batch of {n} rows")
            i = int(index) % n
            return self._take(slice(i, i + 1))
        return self._take(_resolve_index(index, len(self)))

    def __setitem__(self, key: str, value: Any) -> None:
        """Set a field: tensors go to ``tensors``, numpy arrays and lists to ``non_tensors``."""
        if isinstance(value, torch.Tensor):
            value, own, other = _check_tensor(key, value), self.tensors, self.non_tensors
        elif isinstance(value, (np.ndarray, list, tuple)):
            value, own, other = _check_non_tensor(key, value), self.non_tensors, self.tensors
        else:
            raise TypeError(
                f"batch[{key!r}] must be a torch.Tensor, numpy array or list, got {type(value).__name__}; "
                f"put per-batch scalars in batch.meta[{key!r}]"
            )
        for name, k, rows in self._row_counts():
            if k == key:  # the field being replaced does not constrain its replacement
                continue
            if rows != value.shape[0]:
                raise ValueError(
                    f"batch[{key!r}] has {value.shape[0]} rows but {name} has {rows}; "
                    "every field must share dim 0 (the batch size)"
                )
            break
        other.pop(key, None)
        own[key] = value

    # ---- selecting and removing fields ----------------------------------------------------------------

    def select(
        self,
        keys: str | Sequence[str] | None = None,
        non_tensor_keys: str | Sequence[str] | None = None,
        meta_keys: str | Sequence[str] | None = None,
    ) -> Batch:
        """New batch with the named fields (``None`` keeps every field of that kind, as in verl)."""
        keys, non_tensor_keys, meta_keys = _names(keys), _names(non_tensor_keys), _names(meta_keys)
        for names, where, kind in (
            (keys, self.tensors, "tensors"),
            (non_tensor_keys, self.non_tensors, "non_tensors"),
            (meta_keys, self.meta, "meta keys"),
        ):
            if names is not None:
                self._missing(names, where, kind)
        return Batch._new(
            dict(self.tensors) if keys is None else {k: self.tensors[k] for k in keys},
            dict(self.non_tensors)
            if non_tensor_keys is None
            else {k: self.non_tensors[k] for k in non_tensor_keys},
            dict(self.meta) if meta_keys is None else {k: self.meta[k] for k in meta_keys},
        )

    def pop(
        self,
        keys: str | Sequence[str],
        non_tensor_keys: str | Sequence[str] | None = None,
        meta_keys: str | Sequence[str] | None = None,
    ) -> Batch:
        """Remove the named fields from this batch (in place) and return them as a new batch."""
        keys, non_tensor_keys, meta_keys = (
            _names(keys),
            _names(non_tensor_keys) or [],
            _names(meta_keys) or [],
        )
        self._missing(keys, self.tensors, "tensors")
        self._missing(non_tensor_keys, self.non_tensors, "non_tensors")
        self._missing(meta_keys, self.meta, "meta keys")
        return Batch._new(
            {k: self.tensors.pop(k) for k in keys},
            {k: self.non_tensors.pop(k) for k in non_tensor_keys},
            {k: self.meta.pop(k) for k in meta_keys},
        )

    def drop(self, keys: str | Sequence[str], missing_ok: bool = False) -> int:
        """Delete fields (tensor or non-tensor) in place; return the bytes of the dropped tensors."""
        keys = _names(keys)
        if not missing_ok:
            absent = [k for k in keys if k not in self]
            if absent:
                raise KeyError(f"cannot drop {absent}: not in batch (fields are {self.keys()})")
        freed = 0
        for k in keys:
            if k in self.tensors:
                freed += _dense_nbytes(self.tensors.pop(k))
            self.non_tensors.pop(k, None)
        return freed

    def union(self, other: Batch) -> Batch:
        """New batch with the fields of both; a field or meta key present in both must hold equal values."""
        if not isinstance(other, Batch):
            raise TypeError(f"union needs a Batch, got {type(other).__name__}")
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"cannot union batches of different sizes: {len(self)} and {len(other)} rows")
        tensors, non_tensors = dict(self.tensors), dict(self.non_tensors)
        for mine, theirs, clash, kind, equal in (
            (tensors, other.tensors, non_tensors, "tensors", _tensors_equal),
            (non_tensors, other.non_tensors, tensors, "non_tensors", _arrays_equal),
        ):
            for k, v in theirs.items():
                if k in clash:
                    raise ValueError(f"union: {k!r} is a tensor in one batch and a non-tensor in the other")
                if k in mine and not equal(mine[k], v):
                    raise ValueError(
                        f"union: {kind}[{k!r}] differs between the two batches; "
                        "rename or drop it in one of them first"
                    )
                mine.setdefault(k, v)
        return Batch._new(tensors, non_tensors, _merge_meta([self.meta, other.meta], "union"))

    # ---- rows -----------------------------------------------------------------------------------------

    def _map(
        self, fn_t: Callable[[torch.Tensor], torch.Tensor], fn_a: Callable[[np.ndarray], np.ndarray]
    ) -> Batch:
        return Batch._new(
            {k: fn_t(t) for k, t in self.tensors.items()},
            {k: fn_a(a) for k, a in self.non_tensors.items()},
            self.meta,
        )

    def _take(self, rows: slice | np.ndarray) -> Batch:
        if isinstance(rows, slice):
            return self._map(lambda t: t[rows], lambda a: a[rows])
        on_device: dict[torch.device, torch.Tensor] = {}  # one copy of the index per device

        def gather(t: torch.Tensor) -> torch.Tensor:
            if t.device not in on_device:
                on_device[t.device] = torch.from_numpy(rows).to(t.device)
            return t.index_select(0, on_device[t.device])

        return self._map(gather, lambda a: a[rows])

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Permute the rows in place: row ``i`` becomes old row ``indices[i]`` (verl's ``reorder``)."""
        rows = _resolve_index(indices, len(self))
        if isinstance(rows, slice):
            rows = np.arange(len(self))[rows]
        if not np.array_equal(np.sort(rows), np.arange(len(self))):
            raise ValueError(
                f"reorder needs a permutation of range({len(self)}); use batch[indices] to select or repeat rows"
            )
        taken = self._take(rows)
        self.tensors, self.non_tensors = taken.tensors, taken.non_tensors

    def chunk(self, n: int) -> list[Batch]:
        """Split into ``n`` equal parts (views); the size must be divisible by ``n``."""
        if n < 1:
            raise ValueError(f"chunk needs n >= 1, got {n}")
        size, rest = divmod(len(self), n)
        if rest:
            raise ValueError(
                f"cannot chunk a batch of {len(self)} rows into {n} equal parts; pad it first: "
                f"`padded, pad_size = batch.pad_to_divisor({n})`, chunk `padded`, then `unpad(pad_size)` "
                "the concatenated result"
            )
        return [self[i * size : (i + 1) * size] for i in range(n)]

    def split(self, size: int) -> list[Batch]:
        """Parts of ``size`` rows (views); the last one may be smaller. An empty batch gives ``[]``."""
        if size < 1:
            raise ValueError(f"split needs size >= 1, got {size}")
        return [self[i : i + size] for i in range(0, len(self), size)]

    def pad_to_divisor(self, n: int) -> tuple[Batch, int]:
        """Pad to a multiple of ``n`` rows by repeating rows from the start; return (batch, pad_size)."""
        if n < 1:
            raise ValueError(f"pad_to_divisor needs n >= 1, got {n}")
        pad_size = -len(self) % n
        if pad_size == 0:
            return self.select(), 0
        return Batch.concat([self, self._take(np.arange(pad_size) % len(self))]), pad_size

    def unpad(self, pad_size: int) -> Batch:
        """Strip the last ``pad_size`` rows added by ``pad_to_divisor``."""
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"pad_size must be in [0, {len(self)}], got {pad_size}")
        return self[: len(self) - pad_size]

    @staticmethod
    def concat(batches: Sequence[Batch], pad: Padding | None = None) -> Batch:
        """Concatenate along dim 0; fields must match, meta is merged and must agree.

        ``pad`` names the tensor fields whose parts may differ in width (dim 1), e.g. prompts left-padded
        to each part's own longest one: those parts are first padded to the widest, on the given side
        with the given fill value. Every other field must have the same trailing shape in every part.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if b.tensors.keys() != first.tensors.keys() or b.non_tensors.keys() != first.non_tensors.keys():
                diff = sorted(set(b.keys()) ^ set(first.keys()))
                raise ValueError(f"concat: batch {i} and batch 0 have different fields {diff}")
        tensors = {
            k: _concat_field(k, [b.tensors[k] for b in batches], (pad or {}).get(k)) for k in first.tensors
        }
        non_tensors = {}
        for k in first.non_tensors:
            try:
                non_tensors[k] = np.concatenate([b.non_tensors[k] for b in batches], axis=0)
            except ValueError as e:
                raise ValueError(f"concat: non_tensors[{k!r}] cannot be concatenated: {e}") from e
        return Batch._new(tensors, non_tensors, _merge_meta([b.meta for b in batches], "concat"))

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Repeat every row ``n`` times: interleaved ``[a,a,b,b]`` (verl's GRPO layout) or tiled ``[a,b,a,b]``."""
        if n < 1:
            raise ValueError(f"repeat needs n >= 1, got {n}")
        if interleave:
            return self._map(lambda t: t.repeat_interleave(n, dim=0), lambda a: np.repeat(a, n, axis=0))
        return self._map(
            lambda t: t.repeat(n, *([1] * (t.dim() - 1))),
            lambda a: np.tile(a, (n,) + (1,) * (a.ndim - 1)),
        )

    # ---- devices, memory, serialization ---------------------------------------------------------------

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """New batch with every tensor on ``device`` (non-tensors stay on the host)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking), lambda a: a)

    def contiguous(self) -> Batch:
        """New batch with contiguous tensors (already contiguous ones are shared, not copied)."""
        return self._map(lambda t: t.contiguous(), lambda a: a)

    def __getstate__(self) -> dict[str, Any]:
        # Sliced tensors are made compact so a chunk does not drag its parent's whole storage along.
        tensors = {k: _compact(t) for k, t in self.tensors.items()}
        return {"tensors": tensors, "non_tensors": self.non_tensors, "meta": self.meta}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors, self.non_tensors, self.meta = state["tensors"], state["non_tensors"], state["meta"]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the batch to one file with ``torch.save`` of plain containers (loadable with weights_only)."""
        non_tensors = {}
        for k, a in self.non_tensors.items():
            flat = a.reshape(-1)
            # Numpy scalars inside object arrays become Python scalars: weights_only loading refuses them.
            values = (
                [v.item() if isinstance(v, np.generic) else v for v in flat]
                if a.dtype.kind == "O"
                else flat.tolist()
            )
            non_tensors[k] = {"dtype": a.dtype.str, "shape": list(a.shape), "values": values}
        tensors = {k: _compact(t) for k, t in self.tensors.items()}
        torch.save(
            {"format": _SAVE_FORMAT, "tensors": tensors, "non_tensors": non_tensors, "meta": self.meta}, path
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        map_location: str | torch.device | None = None,
        weights_only: bool = True,
    ) -> Batch:
        """Read a batch written by ``save``; ``weights_only=False`` only for files you trust."""
        try:
            state = torch.load(path, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError as e:
            raise ValueError(
                f"{path} holds objects that safe loading refuses ({e}); if you trust the file, "
                "call Batch.load(path, weights_only=False)"
            ) from e
        if not isinstance(state, dict) or state.get("format") != _SAVE_FORMAT:
            raise ValueError(f"{path} is not a file written by Batch.save (format {_SAVE_FORMAT})")
        non_tensors = {}
        for k, d in state["non_tensors"].items():
            dtype = np.dtype(d["dtype"])
            arr = _object_array(d["values"]) if dtype.kind == "O" else np.array(d["values"], dtype=dtype)
            non_tensors[k] = arr.reshape(d["shape"])
        return cls(state["tensors"], non_tensors, state["meta"])

    def __repr__(self) -> str:
        def short(v: Any) -> str:
            r = repr(v)
            return r if len(r) <= 40 else r[:37] + "..."

        tensors = ", ".join(f"{k!r}: {tuple(t.shape)} {t.dtype}" for k, t in self.tensors.items())
        non_tensors = ", ".join(f"{k!r}: {tuple(a.shape)} {a.dtype}" for k, a in self.non_tensors.items())
        meta = ", ".join(f"{k!r}: {short(v)}" for k, v in self.meta.items())
        return (
            f"Batch(batch_size={len(self)},\n  tensors={{{tensors}}},\n"
            f"  non_tensors={{{non_tensors}}},\n  meta={{{meta}}})"
        )


def _concat_field(key: str, parts: list[torch.Tensor], pad: tuple[str, float] | None) -> torch.Tensor:
    """One tensor field of ``Batch.concat``: parts widened to the widest first when ``pad`` allows it."""
    if pad is not None and all(p.dim() >= 2 for p in parts):
        width = max(p.shape[1] for p in parts)
        parts = [_pad_width(p, width, *pad) for p in parts]
    t = parts[0]
    if any(p.shape[1:] != t.shape[1:] or p.dtype != t.dtype for p in parts):
        found = sorted({f"{tuple(p.shape[1:])} {p.dtype}" for p in parts})
        hint = "" if pad is not None else f", or name {key!r} in concat's pad= to pad its width"
        raise ValueError(
            f"concat: tensors[{key!r}] have different trailing shapes or dtypes {found}; "
            f"pad them to a common length and cast to one dtype first{hint}"
        )
    return torch.cat(parts, dim=0)
