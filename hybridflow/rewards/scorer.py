"""``default_compute_score``: the built-in rule-based scorers, chosen by ``data_source`` as verl does."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from hybridflow.rewards import arithmetic, countdown, gsm8k, math_reward, multiply, squares
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

# data_source -> scorer(solution_str, ground_truth, **options). The dataset names are verl's.
SCORERS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": gsm8k.compute_score,
    "lighteval/MATH": math_reward.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_reward.compute_score,
    "HuggingFaceH4/MATH-500": math_reward.compute_score,
    "countdown": countdown.compute_score,
    "arithmetic": arithmetic.compute_score,
    "multiply": multiply.compute_score,
    "squares": squares.compute_score,
    # verl's geo3k rows: numeric / LaTeX answers, compared like MATH's (the last \boxed{} of the response).
    "hiyouga/geometry3k": math_reward.compute_score,
}


def known_data_sources() -> list[str]:
    """The data sources the built-in scorers handle."""
    return sorted(SCORERS)


@functools.cache
def _options(scorer: Callable[..., float]) -> frozenset[str]:
    """Keyword options a scorer accepts besides the response and the ground truth."""
    names = inspect.signature(scorer).parameters
    return frozenset(names) - {"solution_str", "ground_truth"}


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> float:
    """Score one response with the built-in scorer of ``data_source``.

    Keyword arguments the scorer takes (``method`` and ``format_score`` for gsm8k, ``format_score`` for
    countdown, ...) are passed on; others are ignored, so one ``reward_kwargs`` can serve a mixed batch.
    """
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise UserError(
            f"no built-in reward function for data_source {data_source!r}; known: "
            f"{', '.join(known_data_sources())}. Set reward.custom_function.path (a .py file or "
            "'module:function') to score other data"
        )
    options = {k: v for k, v in kwargs.items() if k in _options(scorer)}
    ignored = set(kwargs) - set(options)
    if ignored:
        logger.debug("scorer for %s ignores reward kwargs %s", data_source, sorted(ignored))
    return float(scorer(solution_str, ground_truth, **options))
