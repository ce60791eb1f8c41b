"""The config keys a user set, and their values: in a YAML file or dict and in ``key=value`` overrides.

verl's spellings are resolved to our paths, so a key counts as set whichever spelling set it. The Python APIs
check their keywords against these, and the layout planner keeps every layout key among them as set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.config.aliases import resolve_alias
from hybridflow.config.loader import parse_overrides


def given_overrides(overrides: list[str]) -> dict[str, Any]:
    """Our config path -> value of each ``key=value`` override (verl aliases resolved; the last one wins)."""
    return {resolve_alias(key)[0]: value for key, value in parse_overrides(overrides)}


def file_values(file: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Our config path -> value of every leaf a YAML config (or dict) sets, verl's spellings resolved."""
    out: dict[str, Any] = {}
    for key, value in file.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(file_values(value, path + "."))
        else:
            out[resolve_alias(path)[0]] = value
    return out


def user_keys(file: Mapping[str, Any], overrides: list[str]) -> set[str]:
    """The config paths a YAML file (or dict) and ``key=value`` overrides set (verl spellings resolved).

    A mapping value (``actor.fsdp={param_offload: true}``) counts key by key, as it would in a file.
    """
    given = set(file_values(file))
    for key, value in parse_overrides(overrides):
        given |= set(file_values({key: value}))
    return given
