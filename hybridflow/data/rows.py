"""Reading, writing and validating dataset rows in verl's schema, with errors that name the file and row.

A row of an RL prompt dataset (verl's schema)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],      # chat messages, or a plain text prompt
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 3}}

Ground-truth rule: a non-empty str, a finite int/float (not bool), or a non-empty list/dict (e.g.
countdown's ``{"target": 24, "numbers": [...]}``). ``None``, ``True``/``False``, NaN and empty values are
rejected: they almost always come from a broken conversion, and a scorer would silently score 0 on them.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.utils.errors import UserError
from hybridflow.utils.storage import read_utf8_lines

BUILT_IN = "built-in"
_MISSING = object()


class DataError(UserError):
    """Bad input data; the message names the file and the row (and the line for jsonl)."""

    def __init__(
        self, message: str, file: str | None = None, row: int | None = None, line: int | None = None
    ):
        super().__init__(message)
        self.file, self.row, self.line = file, row, line


@dataclass(frozen=True)
class RowOrigin:
    """Where one row came from: the file (or 'built-in'), its row number in that file, and its jsonl line."""

    file: str
    row: int
    line: int | None = None

    def describe(self) -> str:
        """'train.jsonl: row 3 (line 5)' style location for error messages."""
        line = f" (line {self.line})" if self.line is not None else ""
        return f"{self.file}: row {self.row}{line}"


class Rows(list):
    """A ``list[dict]`` of rows that also remembers where each row came from (``origins``)."""

    def __init__(self, rows: Iterable[dict] = (), origins: Sequence[RowOrigin] | None = None) -> None:
        super().__init__(rows)
        self.origins: list[RowOrigin] = list(origins) if origins is not None else []
        assert not self.origins or len(self.origins) == len(self), "one origin per row"


def origins_of(rows: Sequence[Any], source: str | None) -> list[RowOrigin]:
    """The origin of every row: the ones ``load_rows`` recorded, else ``source`` (default 'built-in') + index."""
    recorded = getattr(rows, "origins", None)
    if recorded:
        return list(recorded)
    name = source if source is not None else BUILT_IN
    return [RowOrigin(name, i) for i in range(len(rows))]


def source_name(origins: Sequence[RowOrigin], source: str | None) -> str:
    """The name of a dataset in log lines: ``source``, else its files joined, else 'built-in'."""
    if source is not None:
        return source
    return ", ".join(dict.fromkeys(o.file for o in origins)) or BUILT_IN


def row_error(origin: RowOrigin, problem: str) -> DataError:
    """A DataError whose message starts with the row's location."""
    return DataError(f"{origin.describe()}: {problem}", file=origin.file, row=origin.row, line=origin.line)


# ---- file I/O ---------------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> Rows:
    rows, origins = [], []
    for line_no, line in enumerate(read_utf8_lines(path), start=1):
        if not line.strip():
            continue  # blank lines (often a trailing newline) are not rows
        origin = RowOrigin(str(path), len(rows), line_no)
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise row_error(
                origin, f"invalid JSON ({e.msg} at column {e.colno}); fix or delete the line"
            ) from None
        if not isinstance(row, dict):
            raise row_error(origin, f"expected a JSON object per line, got {type(row).__name__}")
        rows.append(row)
        origins.append(origin)
    return Rows(rows, origins)


def _read_parquet(path: Path) -> Rows:
    import pyarrow.parquet as pq  # imported here so `import hybridflow.data` stays light

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read as parquet ({e})", file=str(path)) from e
    return Rows(rows, [RowOrigin(str(path), i) for i in range(len(rows))])


def load_rows(path: str | os.PathLike | Sequence[str | os.PathLike]) -> Rows:
    """Read rows from a .parquet or .jsonl file (or a list of them, concatenated); raises DataError if empty."""
    if not isinstance(path, (str, os.PathLike)):
        out = Rows()
        for p in path:
            part = load_rows(p)
            out.extend(part)
            out.origins.extend(part.origins)
        if not out:
            raise DataError("no data files given; pass at least one .parquet or .jsonl path")
        return out
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(
            f"{p}: data file not found; check the path (data.train_files / data.val_files)", str(p)
        )
    if p.suffix == ".parquet":
        rows = _read_parquet(p)
    elif p.suffix == ".jsonl":
        rows = _read_jsonl(p)
    else:
        raise DataError(f"{p}: unsupported data file type {p.suffix!r}; use .parquet or .jsonl", str(p))
    if not rows:
        raise DataError(f"{p}: the file has no rows; it is empty or was written incompletely", str(p))
    return rows


def save_rows(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Write rows to a .parquet (one column per top-level key) or .jsonl file, creating the directory."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.Table.from_pylist([dict(r) for r in rows])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise UserError(
                f"{p}: cannot store these rows as parquet ({e}); parquet needs one type per column "
                "across rows, so write .jsonl for mixed types"
            ) from e
        pq.write_table(table, p)
    elif p.suffix == ".jsonl":
        with p.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    else:
        raise UserError(f"{p}: unsupported data file type {p.suffix!r}; use .parquet or .jsonl")


# ---- validation -------------------------------------------------------------------------------------------


def lookup(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]``, following dots into nested dicts ('reward_model.ground_truth'); ``_MISSING`` if absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def is_missing(value: Any) -> bool:
    """Whether ``lookup`` found nothing (a None value counts as missing too: parquet fills absent keys)."""
    return value is _MISSING or value is None


def check_prompt(value: Any, origin: RowOrigin, key: str) -> str | list[dict[str, str]]:
    """Validate a prompt: a non-empty str, or a non-empty list of {"role": str, "content": str} messages."""
    if is_missing(value):
        raise row_error(origin, f"missing column {key!r}; every row needs a prompt (chat messages or text)")
    if isinstance(value, str):
        if not value.strip():
            raise row_error(origin, f"empty prompt in column {key!r}")
        return value
    if isinstance(value, (list, tuple, np.ndarray)):  # parquet via pandas/HF datasets gives arrays
        messages = []
        for i, m in enumerate(value):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise row_error(
                    origin, f"{key}[{i}] must be a message dict with a str 'role', got {_short(m)}"
                )
            if not isinstance(m.get("content"), str):
                raise row_error(
                    origin,
                    f"{key}[{i}]['content'] must be a str, got {type(m.get('content')).__name__}; "
                    "multimodal content is not supported",
                )
            messages.append({"role": m["role"], "content": m["content"]})
        if not any(m["content"].strip() for m in messages):
            raise row_error(origin, f"empty prompt in column {key!r} (no message has any content)")
        return messages
    raise row_error(
        origin,
        f"column {key!r} must be a list of chat messages or a str, got {type(value).__name__} "
        f"{_short(value)}",
    )


def check_ground_truth(value: Any, origin: RowOrigin) -> Any:
    """Validate a ground truth by the module's rule (str / finite number / non-empty list or dict)."""
    if is_missing(value):
        raise row_error(
            origin, "missing column reward_model.ground_truth; add {'reward_model': {'ground_truth': ...}}"
        )
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, bool):
        ok = False
    elif isinstance(value, str):
        ok = bool(value.strip())
    elif isinstance(value, numbers.Real):
        ok = math.isfinite(value)
    elif isinstance(value, (list, tuple, Mapping)):
        ok = len(value) > 0
    else:
        ok = False
    if not ok:
        raise row_error(
            origin,
            f"reward_model.ground_truth must be a non-empty str, a finite int/float, or a non-empty "
            f"list/dict; got {type(value).__name__} {_short(value)}",
        )
    return value


def check_str_field(value: Any, origin: RowOrigin, key: str) -> str:
    """A required non-empty str column (e.g. data_source)."""
    if is_missing(value):
        raise row_error(origin, f"missing column {key!r}")
    if not isinstance(value, str) or not value:
        raise row_error(
            origin, f"column {key!r} must be a non-empty str, got {type(value).__name__} {value!r}"
        )
    return value


def check_extra_info(value: Any, origin: RowOrigin) -> dict[str, Any]:
    """``extra_info`` is optional; when present it must be a dict."""
    if is_missing(value):
        return {}
    if not isinstance(value, Mapping):
        raise row_error(origin, f"column 'extra_info' must be a dict, got {type(value).__name__}")
    return dict(value)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
