"""The notebook API's keywords (the HybridFlow write-ups' and TRL's) as config keys.

| keyword | config key |
|---|---|
| ``model_name`` | ``model.path`` |
| ``algorithm`` | ``algorithm.adv_estimator`` |
| ``max_steps`` | ``trainer.total_training_steps`` |
| ``learning_rate`` | ``actor.optim.lr`` |
| ``num_generations`` | ``rollout.n`` |
| ``per_device_train_batch_size`` | ``actor.ppo_micro_batch_size_per_gpu`` (samples per GPU per forward/backward) |
| ``gradient_accumulation_steps`` | ``actor.ppo_mini_batch_size`` = per_device x steps x GPUs / num_generations prompts (one optimizer step), and ``data.train_batch_size`` the same unless set |
| ``use_3d_hybrid`` | ``actor.hybrid_engine`` |

A keyword and an override (``overrides=["actor.optim.lr=1e-5"]``, verl's spelling included) that set the same
key to different values are refused, naming both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hybridflow.config import Config, parse_overrides
from hybridflow.config.aliases import resolve_alias
from hybridflow.config.validate import get_path
from hybridflow.utils.errors import UserError

DIRECT = {
    "model_name": "model.path",
    "algorithm": "algorithm.adv_estimator",
    "max_steps": "trainer.total_training_steps",
    "learning_rate": "actor.optim.lr",
    "num_generations": "rollout.n",
    "per_device_train_batch_size": "actor.ppo_micro_batch_size_per_gpu",
    "use_3d_hybrid": "actor.hybrid_engine",
}
MINI_BATCH = "actor.ppo_mini_batch_size"
TRAIN_BATCH = "data.train_batch_size"


def _same(a: Any, b: Any) -> bool:
    """Whether two config values agree (numbers compared as numbers: '1e-6' equals 1e-06)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return str(a).lower() == str(b).lower()
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-12)
    except (TypeError, ValueError):
        return a == b


def given_overrides(overrides: list[str]) -> dict[str, Any]:
    """Our config path -> value of each ``key=value`` override (verl aliases resolved; the last one wins)."""
    return {resolve_alias(key)[0]: value for key, value in parse_overrides(overrides)}


def _value(path: str, chosen: Mapping[str, Any], given: Mapping[str, Any], file: Mapping[str, Any]) -> Any:
    """A key's value as the run will see it: an override, a keyword, the config file, else the default."""
    if path in given:
        return given[path]
    if path in chosen:
        return chosen[path]
    node: Any = file
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node if node is not None else get_path(Config(), path)


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


def keyword_overrides(
    keywords: Mapping[str, Any], overrides: list[str], file: Mapping[str, Any] | None = None
) -> list[str]:
    """The ``key=value`` overrides the keywords stand for (to go before the user's own overrides).

    Raises UserError when a keyword and an override set one key to different values.
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
        if TRAIN_BATCH not in given and TRAIN_BATCH not in (file.get("data") or {}):
            chosen[TRAIN_BATCH] = mini  # one optimizer step per step, as TRL's default
    for path, value in chosen.items():
        if path in given and not _same(given[path], value):
            raise UserError(
                f"{origin.get(path, path)} sets {path}={value!r}, but overrides set {path}={given[path]!r}; "
                "drop one of the two"
            )
    return [f"{path}={_literal(value)}" for path, value in chosen.items()]


def _literal(value: Any) -> str:
    """A value as the right side of a ``key=value`` override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
