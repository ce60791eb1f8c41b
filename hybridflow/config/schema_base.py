"""Field helpers of the config schema: every option carries its default and a one-line help string."""

from __future__ import annotations

import copy
import functools
from dataclasses import field
from typing import Any


def option(default: Any, help: str) -> Any:
    """A dataclass field with its default and a one-line help string (``metadata["help"]``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def section(cls: type, help: str, **overrides: Any) -> Any:
    """A nested-section field: a fresh ``cls(**overrides)`` per instance, with a help string."""
    return field(default_factory=functools.partial(cls, **overrides), metadata={"help": help})


def get_path(cfg: Any, path: str) -> Any:
    """The value at a dotted path, e.g. get_path(cfg, 'actor.optim.lr')."""
    value: Any = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value
