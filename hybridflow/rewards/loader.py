"""Load user reward functions from a Python file or an importable module, and recognise their kind.

``load_reward_function(path, name)`` accepts, as ``reward.custom_function.path``:
  * ``my_reward.py`` (with ``name``, default ``compute_score``), loaded from the file with importlib;
  * ``my_reward.py:fn`` (the part after the colon overrides ``name``);
  * ``package.module:fn`` (or a bare module name with ``name``), imported normally.
Functions loaded from a file are remembered with their ``(path, name)``, so a process pool can load them
again in its workers (a file-loaded module is not importable there, so such a function cannot be pickled).
A module is imported once per process, as Python imports modules: ``import_reward_module`` (which the
trainer calls to find the estimators and losses a reward module registers) and every later load return the
same module object, so its decorators run once and its state is shared.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from hybridflow.utils.errors import UserError
from hybridflow.utils.pyfile import exec_file

# function -> (absolute file path, function name), for the functions load_reward_function read from a file.
_FILE_SOURCES: weakref.WeakKeyDictionary[Callable, tuple[str, str]] = weakref.WeakKeyDictionary()


def _split_spec(path: str, name: str) -> tuple[str, str]:
    """``"target:fn"`` -> ``(target, fn)``; anything else (a Windows drive colon included) keeps ``name``."""
    target, sep, fn_name = path.rpartition(":")
    if sep and target and fn_name.isidentifier():
        return target, fn_name
    return path, name


def _is_file_spec(target: str) -> bool:
    """A target names a file when it ends in .py, contains a path separator or exists as a file."""
    return target.endswith(".py") or os.sep in target or "/" in target or os.path.isfile(target)


def _load_file(path: str) -> ModuleType:
    """Execute a .py file as a module (named after its absolute path), or return it if already executed."""
    abs_path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(abs_path):
        raise UserError(
            f"reward function file not found: {abs_path} (from {path!r}); give an existing .py file, "
            "or 'package.module:function' for an importable module"
        )
    module_name = "_hybridflow_reward_" + hashlib.sha1(abs_path.encode()).hexdigest()[:12]
    return exec_file(Path(abs_path), module_name, f"reward file {path!r}")


def _import_module(target: str) -> ModuleType:
    """Import ``target`` as a module, turning import failures into a message with the fix."""
    try:
        return importlib.import_module(target)
    except ImportError as exc:
        raise UserError(
            f"cannot import reward module {target!r}: {exc}; give a .py file path or an importable "
            "'package.module:function'"
        ) from exc
    except Exception as exc:  # the module's own code failed: name it, as for a file
        raise UserError(f"importing reward module {target!r} failed: {type(exc).__name__}: {exc}") from exc


def _check_path(path: str) -> None:
    if not isinstance(path, str) or not path.strip():
        raise UserError(f"reward function path must be a non-empty string, got {path!r}")


def reward_file(path: str) -> str | None:
    """The .py file a ``reward.custom_function.path`` names (``file.py[:fn]``), or None for a module's name."""
    target, _ = _split_spec(path.strip(), "compute_score")
    return target if _is_file_spec(target) else None


def import_reward_module(path: str) -> ModuleType:
    """The module a ``reward.custom_function.path`` names (``file.py[:fn]``, ``pkg.module[:fn]``), imported once."""
    _check_path(path)
    target, _ = _split_spec(path.strip(), "compute_score")
    return _load_file(target) if _is_file_spec(target) else _import_module(target)


def load_reward_function(path: str, name: str = "compute_score") -> Callable:
    """Load the reward function ``name`` from a .py file or an importable module (``module:function``)."""
    _check_path(path)
    target, fn_name = _split_spec(path.strip(), name)
    from_file = _is_file_spec(target)
    module = import_reward_module(target)
    where = module.__file__ if from_file else target
    if not hasattr(module, fn_name):
        available = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and not isinstance(v, type)
        )
        raise UserError(
            f"reward function {fn_name!r} not found in {where}; functions there: "
            f"{', '.join(available) or 'none'}. Set reward.custom_function.name to one of them"
        )
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise TypeError(
            f"{fn_name!r} in {where} is a {type(fn).__name__}, not a function; "
            "reward.custom_function.name must name a function"
        )
    if from_file:
        _FILE_SOURCES[fn] = (str(module.__file__), fn_name)
    return fn


def file_source(fn: Callable) -> tuple[str, str] | None:
    """``(path, name)`` of a function ``load_reward_function`` loaded from a file, else None."""
    try:
        return _FILE_SOURCES.get(fn)
    except TypeError:  # not weak-referenceable (a builtin or some callables): never loaded from a file
        return None


def is_token_reward_function(fn: Callable) -> bool:
    """True when ``fn`` takes token ids: it has parameters named ``prompt_ids`` and ``response_ids``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return "prompt_ids" in params and "response_ids" in params


def describe_function(fn: Callable) -> str:
    """A readable name for error messages: ``module.qualname`` or the file it came from."""
    source = file_source(fn)
    if source is not None:
        return f"{source[1]} ({source[0]})"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if module else qualname
