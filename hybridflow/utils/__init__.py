"""L0 helpers: logging, timers, seeding, masked tensor statistics, distributed helpers."""

from hybridflow.utils.logging import get_logger
from hybridflow.utils.seed import set_seed
from hybridflow.utils.timer import Timer, timed
from hybridflow.utils.torch_functional import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "Timer",
    "entropy_from_logits",
    "get_logger",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "set_seed",
    "timed",
]
