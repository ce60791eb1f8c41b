"""Prompt and response lengths for the Python APIs, taken from the model and the data unless the user sets them.

``RLTrainer`` and the step-wise ``Trainer`` (not the CLI, whose config keeps its explicit values):

* ``data.max_response_length`` defaults to verl's 512, or half the model's positions when 512 would leave less
  than half of them to the prompt;
* ``data.max_prompt_length`` is the dataset's longest prompt after the chat template (``RLTrainer``), at most
  the model's positions minus the response length; longer prompts are filtered out (``RLDataset`` counts them
  in one log line). The step-wise ``Trainer`` sees no dataset before its first ``generate``: its limit is
  that cap itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hybridflow.config import Config
from hybridflow.data import RLDataset
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

VERL_RESPONSE_LENGTH = 512  # verl's data.max_response_length
PROMPT = "data.max_prompt_length"
RESPONSE = "data.max_response_length"
NO_LIMIT = 1 << 30  # a prompt limit that filters nothing (the model states no position limit)


def position_limit(cfg: Config) -> int | None:
    """The policy's position limit (``max_position_embeddings``; GPT-2's ``n_positions``), None if unstated."""
    from hybridflow.models.loader import load_config as load_model_config

    m = cfg.model
    config = load_model_config(m.path, m.trust_remote_code, dict(m.override_config))
    limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def default_response_length(limit: int | None) -> int:
    """verl's 512, or half the model's positions when 512 would leave the prompt less than half of them."""
    if limit is None or limit >= 2 * VERL_RESPONSE_LENGTH:
        return VERL_RESPONSE_LENGTH
    length = max(1, limit // 2)
    logger.info(
        "%s=%d: half the model's %d positions (verl's %d would leave a prompt less than half of them)",
        RESPONSE,
        length,
        limit,
        VERL_RESPONSE_LENGTH,
    )
    return length


def prompt_cap(limit: int | None, response_length: int) -> int | None:
    """The longest prompt that leaves room for a whole response: the positions minus the response length."""
    if limit is None:
        return None
    if response_length >= limit:
        raise UserError(
            f"{RESPONSE}={response_length} leaves no room for a prompt in the model's {limit} positions "
            f"(max_position_embeddings); set max_completion_length= (or {RESPONSE}) below {limit}"
        )
    return limit - response_length


def longest_prompt(datasets: Sequence[RLDataset | None]) -> int:
    """The longest prompt (tokens, after the chat template) over the datasets."""
    return max(len(item["input_ids"]) for ds in datasets if ds is not None for item in ds.items)


def prompt_length_line(length: int, cap: int | None, limit: int | None, response: int, source: Any) -> None:
    """Say once where ``data.max_prompt_length`` came from."""
    bound = (
        f"at most {cap}: the model's {limit} positions minus {RESPONSE}={response}"
        if cap is not None
        else "the model states no position limit"
    )
    logger.info("%s=%d: the longest prompt of %s after the chat template (%s)", PROMPT, length, source, bound)
