"""Datasets as users hold them, turned into rows of verl's schema for ``RLDataset``.

``as_rows(data)`` accepts a parquet/JSONL path (or a list of them), a list of dicts, a Hugging Face
``datasets.Dataset`` (or anything with ``to_list()``, a pandas ``DataFrame`` too), plain prompt strings,
chat-message lists, and ``Rows`` read by ``load_rows`` (errors keep naming their files).
``data.train_files`` / ``data.val_files`` go through the same function (``builder``), so a file gives the
same prompts on the command line as from Python. Rows keep verl's schema where they have it; otherwise:

  * the prompt and the reference answer come from ``messages`` (ultrachat, TRL's SFT format) or
    ``completion`` (TRL's prompt-completion format) by the rule of ``data.conversations``; the reference
    answer lands in ``extra_info["answer"]`` and, for a row without a ground truth, in
    ``reward_model.ground_truth``; what the rule did is logged once per dataset, never once per row;
  * a missing ``data_source`` becomes ``DEFAULT_SOURCE``; a top-level ``ground_truth`` column becomes
    ``reward_model.ground_truth``;
  * with ``columns_as_extra_info`` (for TRL-style reward functions) the row's other columns and its prompt go
    into ``extra_info``, from which the reward function receives them as keyword arguments.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hybridflow.data.conversations import ANSWER_KEY, MESSAGES_KEY, Resolution, is_chat, resolve_prompt
from hybridflow.data.rows import DataError, RowOrigin, Rows, load_rows

logger = logging.getLogger(__name__)

DEFAULT_SOURCE = "dataset"
SCHEMA_KEYS = ("data_source", "reward_model", "extra_info", "ability")


def _is_path(data: Any) -> bool:
    if isinstance(data, (str, os.PathLike)):
        return True
    return isinstance(data, (list, tuple)) and bool(data) and all(isinstance(p, Path) for p in data)


def _records(data: Any) -> tuple[list[Any], list[RowOrigin] | None, str]:
    """The raw records of ``data``, their origins when read from files, and the dataset's name."""
    if _is_path(data) or (isinstance(data, Rows) and data.origins):
        rows = data if isinstance(data, Rows) else load_rows(data)
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


def _has_ground_truth(row: Mapping[str, Any]) -> bool:
    reward_model = row.get("reward_model")
    return isinstance(reward_model, Mapping) and reward_model.get("ground_truth") is not None


def _place_answer(row: dict[str, Any], answer: str) -> bool:
    """Put the reference answer in extra_info and, lacking one, the ground truth; True for the latter."""
    info = row.get("extra_info")
    if info is None or isinstance(info, Mapping):  # anything else is refused by RLDataset, naming the row
        info = dict(info or {})
        if (
            info.get(ANSWER_KEY) is None
        ):  # an answer the row has is kept (parquet fills absent ones with None)
            info[ANSWER_KEY] = answer
        row["extra_info"] = info
    if _has_ground_truth(row):
        return False
    row["reward_model"] = {**(row.get("reward_model") or {}), "ground_truth": answer}
    return True


class Notices:
    """Counts what the row rules did, for one log line each per dataset (never one per row)."""

    def __init__(self) -> None:
        self.rows = self.conversations = self.text_and_messages = self.chat_over_messages = 0
        self.answers = self.truths = 0

    def add(self, resolution: Resolution, truth_from_answer: bool) -> None:
        """Count one row's resolution."""
        self.rows += 1
        # A row with a text prompt and messages is announced by its own line, which says the same.
        self.conversations += resolution.source == MESSAGES_KEY and not resolution.text_and_messages
        self.text_and_messages += resolution.text_and_messages
        self.chat_over_messages += resolution.source == "prompt over messages"
        self.answers += resolution.answer is not None
        self.truths += truth_from_answer

    def log(self, name: str, prompt_key: str) -> None:
        """One line for each rule that applied to some rows."""
        n = self.rows
        if self.text_and_messages:
            logger.info(
                "%s: %d of %d rows have both a %r string and 'messages': the prompt is taken from messages "
                "(every turn up to the last user turn, chat-templated); drop the 'messages' column to use "
                "the %r text instead",
                *(name, self.text_and_messages, n, prompt_key, prompt_key),
            )
        if self.chat_over_messages:
            logger.info(
                "%s: %d of %d rows have both chat messages in %r and a 'messages' column: the prompt is %r "
                "(as verl and TRL read it); 'messages' is not used",
                *(name, self.chat_over_messages, n, prompt_key, prompt_key),
            )
        if self.conversations:
            logger.info(
                "%s: %d of %d rows are conversations ('messages'): the prompt is every turn up to the last "
                "user turn, earlier assistant turns included",
                *(name, self.conversations, n),
            )
        if self.answers:
            logger.info(
                "%s: %d of %d rows have a reference answer (the last assistant turn after the prompt, or "
                "'completion'): it is extra_info['answer'], and the ground truth of the %d rows without one",
                *(name, self.answers, n, self.truths),
            )


def normalise_row(
    record: Any,
    prompt_key: str = "prompt",
    source_key: str = "data_source",
    columns_as_extra_info: bool = False,
    origin: RowOrigin | None = None,
    notices: Notices | None = None,
) -> Any:
    """One record as a row of verl's schema (see the module docstring); a non-dict record is kept as is."""
    if isinstance(record, str) or is_chat(record):
        record = {prompt_key: record}
    if not isinstance(record, Mapping):
        return record  # RLDataset refuses it, naming the row
    row = dict(record)
    resolution = resolve_prompt(row, prompt_key, origin or RowOrigin("dataset", 0))
    if row.get(source_key) is None:
        row[source_key] = DEFAULT_SOURCE
    if row.get("ground_truth") is not None and not _has_ground_truth(row):
        row["reward_model"] = {**(row.get("reward_model") or {}), "ground_truth": row["ground_truth"]}
    truth_from_answer = resolution.answer is not None and _place_answer(row, resolution.answer)
    if notices is not None:
        notices.add(resolution, truth_from_answer)
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
    origins = origins or [RowOrigin(name, i) for i in range(len(records))]
    notices = Notices()
    rows = [
        normalise_row(r, prompt_key, source_key, columns_as_extra_info, o, notices)
        for r, o in zip(records, origins)
    ]
    notices.log(name, prompt_key)
    return Rows(rows, origins), name
