"""Reward functions in the shapes users bring, recognised from their signatures before anything runs.

``recognise_reward(fn)`` returns a ``RewardShape``: the function the ``RewardManager`` calls (one of its
kinds) and which shape it was. The accepted shapes:

  * ``text``: ``fn(response) -> float``, one string, the response text (the HybridFlow write-ups' lambda);
  * ``verl``: ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float`` (verl's
    ``compute_score``; four positional parameters under other names are taken in that order);
  * ``verl_batch``: ``fn(data_sources, solution_strs, ground_truths, extra_infos) -> list[float]``;
  * ``trl``: TRL's batched ``fn(completions, **kwargs) -> list[float]`` (``prompts`` and the dataset's other
    columns arrive as keyword lists, ``ground_truth`` among them when the rows have one; completions are
    strings for text prompts and ``[{"role": "assistant", "content": ...}]`` for chat prompts, as in TRL);
  * ``token``: ``fn(prompt_ids, response_ids, tokenizer) -> float`` on token ids (nothing is decoded).

Anything else is refused with a ``UserError`` naming these shapes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.rewards.loader import describe_function, is_token_reward_function
from hybridflow.utils.errors import UserError

VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_BATCH_PARAMS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
PROMPT_COLUMN = "prompt"  # the extra_info key the notebook API keeps the row's prompt under for TRL functions
ACCEPTED = (
    "fn(response: str) -> float; "
    "fn(data_source, solution_str, ground_truth, extra_info=None) -> float (verl); "
    "fn(data_sources, solution_strs, ground_truths, extra_infos) -> list[float] (verl batch); "
    "fn(completions, **kwargs) -> list[float] (TRL, batched); "
    "fn(prompt_ids, response_ids, tokenizer) -> float (token ids)"
)


@dataclass(frozen=True)
class RewardShape:
    """A recognised reward function: ``call`` for the ``RewardManager`` of ``kind``; ``shape`` names it."""

    shape: str  # text, verl, verl_batch, trl or token
    call: Callable
    kind: str  # the RewardManager kind: naive, batch or token
    name: str

    @property
    def needs_ground_truth(self) -> bool:
        """Whether every row must carry a ground truth (verl's shapes read it; the others need not)."""
        return self.shape in ("verl", "verl_batch")


class TextReward:
    """Calls ``fn(solution_str)`` in verl's per-sample form (picklable when ``fn`` is)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        return self.fn(solution_str)


class PositionalReward:
    """Calls a four-parameter verl function positionally (its own parameter names differ from verl's)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        return self.fn(data_source, solution_str, ground_truth, extra_info)


class TRLReward:
    """Calls a TRL reward function once per batch: ``fn(completions=..., prompts=..., **columns)``."""

    def __init__(self, fn: Callable, takes_prompts: bool) -> None:
        self.fn, self.takes_prompts = fn, takes_prompts

    def __call__(
        self,
        data_sources: Sequence[Any],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict | None],
        **reward_kwargs: Any,
    ) -> Any:
        infos = [info or {} for info in extra_infos]
        prompts = [info.get(PROMPT_COLUMN) for info in infos]
        completions: list[Any] = [
            text if not isinstance(p, list) else [{"role": "assistant", "content": text}]
            for p, text in zip(prompts, solution_strs)
        ]
        columns = {k: [info.get(k) for info in infos] for k in dict.fromkeys(k for i in infos for k in i)}
        columns.pop(PROMPT_COLUMN, None)
        if any(g is not None for g in ground_truths):
            columns.setdefault("ground_truth", list(ground_truths))
        kwargs = {**columns, **reward_kwargs}
        if self.takes_prompts:
            kwargs["prompts"] = prompts
        return self.fn(completions=completions, **kwargs)


def _parameters(fn: Callable) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return None


def _required_positional(params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in params if p.kind in positional and p.default is inspect.Parameter.empty]


def _shape_of(fn: Callable, params: list[inspect.Parameter]) -> str | None:
    """The shape's name from the parameters, or None when none fits."""
    names = {p.name for p in params}
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if is_token_reward_function(fn):
        return "token"
    if set(VERL_BATCH_PARAMS[:2]) <= names:
        return "verl_batch"
    if "solution_str" in names:
        return "verl"
    if "completions" in names:
        return "trl"
    required = _required_positional(params)
    if len(required) == 1 and len(positional) <= 2:  # fn(x) or fn(x, y=default)
        return "text"
    if len(required) in (3, 4) and len(positional) <= 4:
        return "verl_positional"
    return None


def recognise_reward(fn: Callable) -> RewardShape:
    """The shape of reward function ``fn`` and the call the reward manager makes; UserError if none fits."""
    if not callable(fn):
        raise UserError(f"reward_fn must be a function, got {type(fn).__name__}; accepted shapes: {ACCEPTED}")
    name = describe_function(fn)
    params = _parameters(fn)
    shape = _shape_of(fn, params) if params is not None else None
    if shape is None:
        got = f"({', '.join(str(p) for p in params)})" if params is not None else "(no signature)"
        raise UserError(
            f"reward_fn {name}{got} fits none of the accepted shapes: {ACCEPTED}; "
            "change its parameters to one of them"
        )
    if shape == "token":
        return RewardShape("token", fn, "token", name)
    if shape == "verl_batch":
        return RewardShape("verl_batch", fn, "batch", name)
    if shape == "verl":
        return RewardShape("verl", fn, "naive", name)
    if shape == "verl_positional":
        return RewardShape("verl", PositionalReward(fn), "naive", name)
    if shape == "trl":
        takes_prompts = any(p.name == "prompts" or p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        return RewardShape("trl", TRLReward(fn, takes_prompts), "batch", name)
    return RewardShape("text", TextReward(fn), "naive", name)
