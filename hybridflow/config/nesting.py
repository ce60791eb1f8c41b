"""How deep a config may nest: a bound checked before any recursive walk over user data.

A config's sections nest a few levels (``actor.fsdp.offload``; a free-form ``model.override_config`` a few
more). A YAML file, an override value or a Python dict nested thousands of levels deep (or one that holds
itself, through a YAML alias or a dict put inside itself) would exhaust Python's recursion in PyYAML, in the
loader's walk or in ``copy.deepcopy``; it is refused first, naming where it came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.config.errors import ConfigError, Problem

MAX_DEPTH = 100  # mappings and lists inside each other; a real config uses fewer than ten
TOO_DEEP = f"nests more than {MAX_DEPTH} levels deep (mappings or lists inside each other)"
FIX = "a config's sections nest a few levels; look for a runaway structure (a generated file, a loop)"


def _children(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return []


def nesting_problem(value: Any) -> str | None:
    """Why ``value`` nests too deep for a config (too many levels, or it holds itself); None if it does not.

    A depth-first walk with an explicit stack (the check itself never recurses) that visits each mapping or
    list once, however often YAML aliases share it.
    """
    heights: dict[int, int] = {}  # id -> levels of mappings and lists from it down (finished nodes)
    open_: set[int] = set()  # started, not finished: the path from the top to the node being walked
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        node, finished = stack.pop()
        children = [c for c in _children(node) if _children(c)]  # leaves and empty ones add nothing
        key = id(node)
        if finished:
            heights[key] = 1 + max((heights[id(c)] for c in children), default=0)
            open_.discard(key)
            if heights[key] > MAX_DEPTH:
                return TOO_DEEP
        elif key in open_:
            return "holds itself (a YAML alias to an enclosing anchor, or a dict put inside itself)"
        elif key not in heights:
            open_.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children)
    return None


def check_nesting(value: Any, where: str) -> None:
    """Refuse ``value`` (read from ``where``: a file, a key) when it nests too deep; ConfigError naming it."""
    problem = nesting_problem(value)
    if problem is not None:
        raise ConfigError([Problem(where, problem, FIX)])
