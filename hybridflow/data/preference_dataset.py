"""Preference datasets for offline training: DPO pairs (prompt, chosen, rejected) and KTO examples
(prompt, completion, label), their collates into the trainer's layout, and built-in arithmetic pairs.

Responses are rendered as SFT renders them (``render_response``): the assistant turn that follows the
chat-templated prompt, ending with the template's end-of-turn token (EOS for text prompts), so the policy
is pushed towards completions that stop exactly where the rollout engine stops.

Over-long rows, per ``truncation``: 'error' refuses them naming the row, 'filter' drops them (counted in
``num_filtered``), 'left'/'right' cut the prompt as ``RLDataset`` does ('left' keeps its end, next to the
response) and cut responses at their end (a response must still continue its prompt), counted in
``num_truncated``.

    ds = PreferenceDataset(load_rows("pairs.jsonl"), tokenizer, max_prompt_length=256, max_response_length=256)
    batch = collate_pairs([ds[i] for i in idx], tokenizer.pad_token_id)  # 2P rows: chosen, then rejected
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridflow.data.rl_dataset import encode_prompts, truncate
from hybridflow.data.rows import (
    DataError,
    RowOrigin,
    check_prompt,
    is_missing,
    lookup,
    origins_of,
    row_error,
    source_name,
)
from hybridflow.data.sft_dataset import render_response
from hybridflow.protocol import Batch
from hybridflow.utils.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

PREFERENCE_TRUNCATIONS = ("error", "left", "right", "filter")
_STATED = re.compile(r"(####\s*)(-?\d+)")  # the task's answer format, '#### 42'
_NAMED_ROWS = 5  # rows named in a warning before '...'
_PAIR_COLUMNS = "a prompt, a chosen and a rejected response (or set prompt_key/chosen_key/rejected_key)"
_KTO_COLUMNS = "a prompt, a completion and a bool label (or set prompt_key/completion_key/label_key)"


def _check_response(value: Any, origin: RowOrigin, key: str, needed: str) -> str:
    """A completion column: a non-empty str, or a list holding one assistant message (TRL's chat format)."""
    if is_missing(value):
        raise row_error(origin, f"missing column {key!r}; every row needs {needed}")
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) == 1 and isinstance(value[0], Mapping):
        message = value[0]
        if message.get("role") != "assistant":
            raise row_error(
                origin, f"column {key!r} holds a {message.get('role')!r} message; expected assistant"
            )
        value = message.get("content")
    if not isinstance(value, str) or not value.strip():
        raise row_error(
            origin,
            f"column {key!r} must be a non-empty str (or one assistant message), got "
            f"{type(value).__name__} {value!r:.60}",
        )
    return value


class _LengthPolicy:
    """Applies the length limits and the truncation mode to one row, counting what it filters or cuts."""

    def __init__(self, max_prompt_length: int, max_response_length: int, truncation: str) -> None:
        if truncation not in PREFERENCE_TRUNCATIONS:
            raise UserError(f"truncation must be one of {PREFERENCE_TRUNCATIONS}, got {truncation!r}")
        if max_prompt_length < 1 or max_response_length < 1:
            raise UserError(
                f"max_prompt_length and max_response_length must be >= 1, got {max_prompt_length}, "
                f"{max_response_length}"
            )
        self.max_prompt, self.max_response, self.mode = max_prompt_length, max_response_length, truncation
        self.num_filtered = self.num_truncated = 0

    def fit(
        self, origin: RowOrigin, prompt: list[int], responses: dict[str, list[int]]
    ) -> tuple[list[int], dict[str, list[int]]] | None:
        """The row's ids within the limits, or None when it is filtered out."""
        too_long = []
        if len(prompt) > self.max_prompt:
            too_long.append(f"the prompt has {len(prompt)} tokens (max_prompt_length={self.max_prompt})")
        too_long += [
            f"{name} has {len(ids)} tokens (max_response_length={self.max_response})"
            for name, ids in responses.items()
            if len(ids) > self.max_response
        ]
        if not too_long:
            return prompt, responses
        if self.mode == "error":
            raise row_error(
                origin,
                f"{'; '.join(too_long)}; raise the limit, or set truncation=filter|left|right",
            )
        if self.mode == "filter":
            self.num_filtered += 1
            return None
        self.num_truncated += 1
        # Responses keep their start: the tokens right after the prompt are what the model is judged on.
        cut = {name: ids[: self.max_response] for name, ids in responses.items()}
        return truncate(prompt, self.max_prompt, self.mode), cut

    def log(self, source: str, total: int) -> None:
        """Log the filter / truncation counts (nothing when no row was touched)."""
        if self.num_filtered:
            logger.info(
                "%s: filtered out %d of %d rows longer than max_prompt_length=%d / max_response_length=%d",
                *(source, self.num_filtered, total, self.max_prompt, self.max_response),
            )
        if self.num_truncated:
            logger.info(
                "%s: truncated %d of %d rows to max_prompt_length=%d / max_response_length=%d (%s)",
                *(source, self.num_truncated, total, self.max_prompt, self.max_response, self.mode),
            )


def _encode_responses(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Any], responses: Sequence[str]
) -> list[list[int]]:
    tails = [render_response(tokenizer, p, r) for p, r in zip(prompts, responses)]
    return [list(ids) for ids in tokenizer(tails, add_special_tokens=False)["input_ids"]]


def _start(rows: Sequence[Any], source: str | None) -> tuple[list[RowOrigin], str]:
    origins = origins_of(rows, source)
    name = source_name(origins, source)
    if not rows:
        raise DataError(f"{name}: no rows; the dataset is empty", file=name)
    for row, origin in zip(rows, origins):
        if not isinstance(row, dict):
            raise row_error(origin, f"a row must be a dict, got {type(row).__name__}")
    return origins, name


def _named(origins: Sequence[RowOrigin]) -> str:
    named = "; ".join(o.describe() for o in origins[:_NAMED_ROWS])
    return named + ("; ..." if len(origins) > _NAMED_ROWS else "")


class PreferenceDataset:
    """Tokenized DPO pairs; ``ds[i]`` has ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` (list[int]).

    Rows whose chosen and rejected are identical (as text, or as ids after truncation) teach nothing and
    would only dilute the loss: they are dropped, counted in ``num_dropped_equal`` and named in one warning.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_length: int,
        max_response_length: int,
        truncation: str = "error",
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        source: str | None = None,
    ) -> None:
        lengths = _LengthPolicy(max_prompt_length, max_response_length, truncation)
        origins, self.source = _start(rows, source)
        prompts, chosen, rejected = [], [], []
        for row, origin in zip(rows, origins):
            prompts.append(check_prompt(lookup(row, prompt_key), origin, prompt_key))
            chosen.append(_check_response(lookup(row, chosen_key), origin, chosen_key, _PAIR_COLUMNS))
            rejected.append(_check_response(lookup(row, rejected_key), origin, rejected_key, _PAIR_COLUMNS))
        prompt_ids = encode_prompts(tokenizer, prompts)
        chosen_ids = _encode_responses(tokenizer, prompts, chosen)
        rejected_ids = _encode_responses(tokenizer, prompts, rejected)
        self.items: list[dict[str, list[int]]] = []
        self.origins: list[RowOrigin] = []
        equal: list[RowOrigin] = []
        for origin, c_text, r_text, p, c, r in zip(
            origins, chosen, rejected, prompt_ids, chosen_ids, rejected_ids
        ):
            if c_text == r_text:
                equal.append(origin)
                continue
            fitted = lengths.fit(origin, p, {"chosen": c, "rejected": r})
            if fitted is None:
                continue
            p, responses = fitted
            if responses["chosen"] == responses["rejected"]:
                equal.append(origin)  # distinct texts that truncation made identical
                continue
            self.items.append(
                {"prompt_ids": p, "chosen_ids": responses["chosen"], "rejected_ids": responses["rejected"]}
            )
            self.origins.append(origin)
        self.num_dropped_equal = len(equal)
        self.num_filtered, self.num_truncated = lengths.num_filtered, lengths.num_truncated
        if equal:
            logger.warning(
                "%s: dropped %d of %d rows whose chosen equals rejected (nothing to prefer): %s",
                *(self.source, len(equal), len(rows), _named(equal)),
            )
        lengths.log(self.source, len(rows))
        if not self.items:
            raise DataError(
                f"{self.source}: no preference pair is left after dropping bad rows", file=self.source
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.items[i]

    def where(self, i: int) -> str:
        """Where item ``i`` came from, e.g. 'pairs.jsonl: row 3 (line 4)'."""
        return self.origins[i].describe()


class KTODataset:
    """Tokenized KTO examples; ``ds[i]`` has ``prompt_ids``, ``completion_ids`` (list[int]) and ``label``.

    ``label`` must be a bool (True = desirable); strings like "yes" and numbers are refused, since a
    silent truthiness cast would turn "false" into a desirable example.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_length: int,
        max_response_length: int,
        truncation: str = "error",
        prompt_key: str = "prompt",
        completion_key: str = "completion",
        label_key: str = "label",
        source: str | None = None,
    ) -> None:
        lengths = _LengthPolicy(max_prompt_length, max_response_length, truncation)
        origins, self.source = _start(rows, source)
        prompts, completions, labels = [], [], []
        for row, origin in zip(rows, origins):
            prompts.append(check_prompt(lookup(row, prompt_key), origin, prompt_key))
            completions.append(
                _check_response(lookup(row, completion_key), origin, completion_key, _KTO_COLUMNS)
            )
            label = lookup(row, label_key)
            if is_missing(label) or not isinstance(label, (bool, np.bool_)):
                raise row_error(
                    origin,
                    f"column {label_key!r} must be a bool (true = desirable, false = undesirable), got "
                    f"{'nothing' if is_missing(label) else f'{type(label).__name__} {label!r:.40}'}",
                )
            labels.append(bool(label))
        prompt_ids = encode_prompts(tokenizer, prompts)
        completion_ids = _encode_responses(tokenizer, prompts, completions)
        self.items: list[dict[str, Any]] = []
        self.origins: list[RowOrigin] = []
        for origin, p, c, label in zip(origins, prompt_ids, completion_ids, labels):
            fitted = lengths.fit(origin, p, {"completion": c})
            if fitted is not None:
                self.items.append(
                    {"prompt_ids": fitted[0], "completion_ids": fitted[1]["completion"], "label": label}
                )
                self.origins.append(origin)
        self.num_filtered, self.num_truncated = lengths.num_filtered, lengths.num_truncated
        lengths.log(self.source, len(rows))
        if not self.items:
            raise DataError(f"{self.source}: no KTO example is left after filtering", file=self.source)
        desirable = sum(it["label"] for it in self.items)
        logger.info(
            "%s: %d desirable and %d undesirable examples", self.source, desirable, len(self) - desirable
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]

    def where(self, i: int) -> str:
        """Where item ``i`` came from, e.g. 'kto.parquet: row 3'."""
        return self.origins[i].describe()


def _pack(prompts: list[list[int]], responses: list[list[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses, the layout of the engine's ``pack_prompt_response``.

    That function lives in the engine (L3), which the data layer (L2) may not import; this is the same
    layout, with the response width set by the longest response of the batch.
    """
    B, Tp, Tr = len(prompts), max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((B, Tp + Tr), pad_token_id, dtype=torch.long)  # (B, Tp + Tr)
    mask = torch.zeros((B, Tp + Tr), dtype=torch.long)  # (B, Tp + Tr)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, Tp - len(p) : Tp + len(r)] = torch.tensor(p + r, dtype=torch.long)
        mask[b, Tp - len(p) : Tp + len(r)] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),  # (B, Tp + Tr), 0 on the left padding
        "responses": ids[:, Tp:].clone(),  # (B, Tr)
        "response_mask": mask[:, Tp:].float(),  # (B, Tr)
    }


def collate_pairs(items: Sequence[Mapping[str, Any]], pad_token_id: int) -> Batch:
    """One batch of 2P rows for P pairs: rows 0..P-1 are (prompt, chosen), rows P..2P-1 (prompt, rejected).

    Chosen and rejected go through one forward. ``meta['num_pairs'] = P``; fields as the RL trainer's:
    ``input_ids``, ``attention_mask``, ``position_ids`` (2P, Tp + Tr), ``responses``, ``response_mask`` (2P, Tr).
    """
    if not items:
        raise UserError("collate_pairs needs at least one pair")
    prompts = [list(it["prompt_ids"]) for it in items]
    responses = [list(it["chosen_ids"]) for it in items] + [list(it["rejected_ids"]) for it in items]
    return Batch(_pack(prompts + prompts, responses, pad_token_id), meta={"num_pairs": len(items)})


def collate_kto(items: Sequence[Mapping[str, Any]], pad_token_id: int) -> Batch:
    """A batch of 2M rows for M examples: rows 0..M-1 the examples, rows M..2M-1 the KL pairs.

    KL row M + i pairs prompt i with completion (i + 1) mod M, the mismatched pairs KTO estimates its
    reference point on. ``is_kl`` (2M,) marks them; ``labels`` (2M,) is the example's label (False and
    unused on KL rows); ``meta['num_examples'] = M``.
    """
    if len(items) < 2:
        raise UserError(
            f"collate_kto needs at least 2 examples to form mismatched KL pairs, got {len(items)}; "
            "raise the batch size"
        )
    M = len(items)
    prompts = [list(it["prompt_ids"]) for it in items]
    completions = [list(it["completion_ids"]) for it in items]
    shifted = completions[1:] + completions[:1]  # completion (i + 1) mod M
    tensors = _pack(prompts + prompts, completions + shifted, pad_token_id)
    labels = torch.zeros(2 * M, dtype=torch.bool)  # (2M,)
    labels[:M] = torch.tensor([bool(it["label"]) for it in items])
    tensors["labels"] = labels
    tensors["is_kl"] = torch.arange(2 * M) >= M  # (2M,)
    return Batch(tensors, meta={"num_examples": M})


def make_arithmetic_preferences(rows: Sequence[Mapping[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Preference pairs from built-in arithmetic rows: the reference answer against a wrong one.

    ``chosen`` is the row's ``extra_info.answer`` ('#### 42'); ``rejected`` is the same text with the number
    after the last '####' moved by a nonzero offset in [-3, 3] (never below 0 when the truth is >= 0), so
    the arithmetic reward scores chosen 1 and rejected 0. Other columns are kept for evaluation.
    """
    rng = random.Random(f"arithmetic-preferences:{seed}")  # str seeds are stable across processes
    out = []
    for row, origin in zip(rows, origins_of(rows, None)):
        truth = lookup(row, "reward_model.ground_truth")
        try:
            value = int(str(truth).strip())
        except ValueError:
            raise row_error(origin, f"reward_model.ground_truth must be an integer, got {truth!r}") from None
        answer = lookup(row, "extra_info.answer")
        chosen = answer if isinstance(answer, str) else f"#### {value}"
        marker = chosen.rfind("####")
        stated = _STATED.match(chosen, marker) if marker >= 0 else None
        if stated is None or int(stated.group(2)) != value:
            raise row_error(
                origin,
                f"extra_info.answer {chosen!r} does not state '#### {value}'; expected the task's format",
            )
        offsets = [d for d in (-3, -2, -1, 1, 2, 3) if value < 0 or value + d >= 0]
        wrong = value + rng.choice(offsets)
        rejected = chosen[: stated.start(2)] + str(wrong) + chosen[stated.end(2) :]
        out.append({**row, "chosen": chosen, "rejected": rejected})
    return out
