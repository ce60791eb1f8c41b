"""Datasets as users hold them, turned into rows of verl's schema for ``RLDataset``.

``as_rows(data)`` accepts a parquet/JSONL path (or a list of them), a list of dicts, a Hugging Face
``datasets.Dataset`` (or anything with ``to_list()``, a pandas ``DataFrame`` too), plain prompt strings and
chat-message lists. Rows keep verl's schema where they have it; otherwise:

  * a row without the prompt column but with ``messages`` (ultrachat-style conversations) gets as prompt its
    system and user turns (the assistant turns are the dataset's answers, not part of the prompt);
  * a missing ``data_source`` becomes ``DEFAULT_SOURCE``; a top-level ``ground_truth`` column becomes
    ``reward_model.ground_truth``;
  * with ``columns_as_extra_info`` (for TRL-style reward functions) the row's other columns and its prompt go
    into ``extra_info``, from which the reward function receives them as keyword arguments.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hybridflow.data.rows import DataError, RowOrigin, Rows, load_rows

DEFAULT_SOURCE = "dataset"
SCHEMA_KEYS = ("data_source", "reward_model", "extra_info", "ability")
PROMPT_ROLES = ("system", "user")


def _is_path(data: Any) -> bool:
    if isinstance(data, (str, os.PathLike)):
        return True
    return isinstance(data, (list, tuple)) and bool(data) and all(isinstance(p, Path) for p in data)


def _records(data: Any) -> tuple[list[Any], list[RowOrigin] | None, str]:
    """The raw records of ``data``, their origins when read from files, and the dataset's name."""
    if _is_path(data):
        rows = load_rows(data)
        return list(rows), rows.origins, ", ".join(dict.fromkeys(o.file for o in rows.origins))
    if hasattr(data, "to_list") and callable(data.to_list):  # datasets.Dataset
        return list(data.to_list()), None, type(data).__name__
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas.DataFrame
        return list(data.to_dict("records")), None, type(data).__name__
    if isinstance(data, Mapping) or not isinstance(data, Iterable):
        raise DataError(
            f"the dataset is a {type(data).__name__}; give a list of dicts, prompt strings or chat-message "
            "lists, a datasets.Dataset, or a .parquet/.jsonl path"
        )
    return list(data), None, "dataset"


def _prompt_of_messages(messages: Any) -> Any:
    """The system and user turns of a conversation (``messages`` of ultrachat-style rows)."""
    if not isinstance(messages, (list, tuple)) and not hasattr(messages, "tolist"):
        return messages  # RLDataset names the problem with the row
    turns = list(messages.tolist() if hasattr(messages, "tolist") else messages)
    kept = [m for m in turns if not isinstance(m, Mapping) or m.get("role") in PROMPT_ROLES]
    return kept or turns


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) for m in value)


def normalise_row(
    record: Any,
    prompt_key: str = "prompt",
    source_key: str = "data_source",
    columns_as_extra_info: bool = False,
) -> Any:
    """One record as a row of verl's schema (see the module docstring); a non-dict record is kept as is."""
    if isinstance(record, str) or _is_messages(record):
        record = {prompt_key: record}
    if not isinstance(record, Mapping):
        return record  # RLDataset refuses it, naming the row
    row = dict(record)
    if prompt_key not in row and "messages" in row:
        row[prompt_key] = _prompt_of_messages(row["messages"])
    if row.get(source_key) is None:
        row[source_key] = DEFAULT_SOURCE
    reward_model = row.get("reward_model")
    if row.get("ground_truth") is not None and not (
        isinstance(reward_model, Mapping) and reward_model.get("ground_truth") is not None
    ):
        row["reward_model"] = {**(reward_model or {}), "ground_truth": row["ground_truth"]}
    if columns_as_extra_info:
        info = dict(row.get("extra_info") or {})
        for key, value in record.items():
            if key not in (*SCHEMA_KEYS, source_key, prompt_key):
                info.setdefault(key, value)
        info.setdefault("prompt", row.get(prompt_key))
        row["extra_info"] = info
    return row


def as_rows(
    data: Any,
    prompt_key: str = "prompt",
    source_key: str = "data_source",
    columns_as_extra_info: bool = False,
) -> tuple[Rows, str]:
    """Rows of verl's schema from any of the dataset forms of the module docstring, and the dataset's name."""
    records, origins, name = _records(data)
    if not records:
        raise DataError(f"{name}: the dataset has no rows", file=name)
    rows = [normalise_row(r, prompt_key, source_key, columns_as_extra_info) for r in records]
    return Rows(rows, origins or [RowOrigin(name, i) for i in range(len(rows))]), name
