"""The notebook API's keywords (the HybridFlow write-ups' and TRL's) as config keys.

| keyword | config key |
|---|---|
| ``model_name`` | ``model.path`` |
| ``algorithm`` | ``algorithm.adv_estimator`` (``grpo`` unless the config sets it) |
| ``max_steps`` | ``trainer.total_training_steps`` |
| ``learning_rate`` | ``actor.optim.lr`` |
| ``num_generations`` | ``rollout.n`` |
| ``per_device_train_batch_size`` | ``actor.ppo_micro_batch_size_per_gpu`` (samples per GPU per forward/backward) |
| ``gradient_accumulation_steps`` | ``actor.ppo_mini_batch_size`` = per_device x steps x GPUs / num_generations prompts (one optimizer step), and ``data.train_batch_size`` the same unless set |
| ``max_prompt_length`` | ``data.max_prompt_length`` |
| ``max_completion_length`` | ``data.max_response_length`` |
| ``output_dir`` | ``trainer.default_local_dir`` (the run directory) |
| ``use_3d_hybrid`` | ``actor.hybrid_engine`` (true unless the config sets it) |

A keyword and an override (``overrides=["actor.optim.lr=1e-5"]``, verl's spelling included) or a key of the
``config=`` file or dict that set the same key to different values are refused, naming both. A keyword that
is none of these is refused, naming the closest one.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection, Mapping
from typing import Any

from hybridflow.config import Config
from hybridflow.config.suggest import KEYWORD_KEYS
from hybridflow.config.user_keys import given_overrides
from hybridflow.config.validate import get_path
from hybridflow.utils.errors import UserError

DIRECT = KEYWORD_KEYS  # keyword -> the one config key it sets
KEYWORDS = (*DIRECT, "gradient_accumulation_steps")
# The notebook API's own defaults, used where neither a keyword nor the config sets the key.
DEFAULTS = {"algorithm.adv_estimator": "grpo", "actor.hybrid_engine": True}
MINI_BATCH = "actor.ppo_mini_batch_size"
TRAIN_BATCH = "data.train_batch_size"


def check_keywords(given: Collection[str], accepted: Collection[str], who: str) -> None:
    """Refuse a keyword ``who`` does not take, naming the closest one it does (``learning_rat``)."""
    for name in given:
        if name in accepted:
            continue
        close = difflib.get_close_matches(name, list(accepted), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}=?" if close else f"the keywords are {', '.join(sorted(accepted))}"
        raise UserError(
            f"{who} got an unknown keyword {name}=; {hint} (any config key goes through "
            'overrides=["section.key=value"])'
        )


def _same(a: Any, b: Any) -> bool:
    """Whether two config values agree (numbers compared as numbers: '1e-6' equals 1e-06)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return str(a).lower() == str(b).lower()
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-12)
    except (TypeError, ValueError):
        return a == b


def _value(path: str, chosen: Mapping[str, Any], given: Mapping[str, Any], file: Mapping[str, Any]) -> Any:
    """A key's value as the run will see it: an override, a keyword, the config file, else the default."""
    for source in (given, chosen, file):
        if path in source:
            return source[path]
    return get_path(Config(), path)


def _mini_batch(keywords: Mapping[str, Any], chosen: dict, given: Mapping, file: Mapping) -> int:
    """Prompts per optimizer step from per_device_train_batch_size x gradient_accumulation_steps x GPUs."""
    steps = keywords["gradient_accumulation_steps"]
    micro = int(_value(DIRECT["per_device_train_batch_size"], chosen, given, file))
    n = int(_value("rollout.n", chosen, given, file))
    gpus = int(_value("trainer.nnodes", chosen, given, file)) * int(
        _value("trainer.n_gpus_per_node", chosen, given, file)
    )
    samples = micro * int(steps) * gpus
    if int(steps) < 1 or samples % n:
        raise UserError(
            f"gradient_accumulation_steps={steps}: per_device_train_batch_size={micro} x "
            f"gradient_accumulation_steps={steps} x {gpus} GPU(s) = {samples} samples per optimizer step, not a "
            f"whole number of prompts of num_generations={n} samples; make it a multiple of {n}"
        )
    return samples // n


def keyword_paths(keywords: Mapping[str, Any]) -> set[str]:
    """The config keys the given keywords (those not None) set."""
    paths = {DIRECT[k] for k, v in keywords.items() if k in DIRECT and v is not None}
    return paths | ({MINI_BATCH} if keywords.get("gradient_accumulation_steps") is not None else set())


def keyword_overrides(
    keywords: Mapping[str, Any],
    overrides: list[str],
    file: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> list[str]:
    """The ``key=value`` overrides the keywords stand for (to go before the user's own overrides).

    ``file`` is the config file's (or dict's) values by our path (``config.user_keys.file_values``). Raises UserError when a
    keyword and an override, or a keyword and the file, set one key to different values. ``defaults``
    (``DEFAULTS`` when None) are added for the keys that neither the keywords nor the config set.
    """
    given = given_overrides(overrides)
    file = file or {}
    chosen: dict[str, Any] = {DIRECT[k]: v for k, v in keywords.items() if k in DIRECT and v is not None}
    origin = {DIRECT[k]: f"{k}={v!r}" for k, v in keywords.items() if k in DIRECT and v is not None}
    if keywords.get("gradient_accumulation_steps") is not None:
        mini = _mini_batch(keywords, chosen, given, file)
        chosen[MINI_BATCH] = mini
        origin[MINI_BATCH] = (
            f"gradient_accumulation_steps={keywords['gradient_accumulation_steps']!r} (= {mini} prompts)"
        )
        if TRAIN_BATCH not in given and TRAIN_BATCH not in file:
            chosen[TRAIN_BATCH] = mini  # one optimizer step per step, as TRL's default
    for path, value in chosen.items():
        for where, values in (("overrides set", given), ("the config (config=) sets", file)):
            if path in values and not _same(values[path], value):
                raise UserError(
                    f"{origin.get(path, path)} sets {path}={value!r}, but {where} {path}={values[path]!r}; "
                    "drop one of the two"
                )
    for path, value in (DEFAULTS if defaults is None else defaults).items():
        if path not in chosen and path not in given and path not in file:
            chosen[path] = value
    return [f"{path}={_literal(value)}" for path, value in chosen.items()]


def _literal(value: Any) -> str:
    """A value as the right side of a ``key=value`` override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
