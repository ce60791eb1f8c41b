"""L2: reward functions and reward managers (pure functions of plain values, no config objects).

* ``default_compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw)``: built-in
  rule-based scorers keyed by data source (gsm8k, MATH, geo3k, countdown, the built-in tasks).
* ``load_reward_function(path, name)``: a user function from a .py file or ``module:function``.
* ``RewardManager``: scores a batch (naive, batch or token-id functions; errors; optional process pool).
* ``place_on_last_token(scores, response_mask)``: outcome scores as ``(B, R)`` token-level scores.

Importing this package does not import torch (``place_on_last_token`` is loaded on first use), so reward
worker processes start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridflow.rewards.loader import is_token_reward_function, load_reward_function
from hybridflow.rewards.manager import ERRORS_KEY, RewardError, RewardManager
from hybridflow.rewards.pool import RewardTimeoutError, RewardWorkerDiedError
from hybridflow.rewards.scorer import default_compute_score, known_data_sources

if TYPE_CHECKING:
    from hybridflow.rewards.placement import place_on_last_token

__all__ = [
    "ERRORS_KEY",
    "RewardError",
    "RewardManager",
    "RewardTimeoutError",
    "RewardWorkerDiedError",
    "default_compute_score",
    "is_token_reward_function",
    "known_data_sources",
    "load_reward_function",
    "place_on_last_token",
]


def __getattr__(name: str) -> Any:
    """Load ``place_on_last_token`` (the package's only torch user) on first access (PEP 562)."""
    if name == "place_on_last_token":
        from hybridflow.rewards.placement import place_on_last_token

        return place_on_last_token
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
