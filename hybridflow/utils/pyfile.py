"""Running a user's .py file as a module: the one loader behind reward files, harness files and verifiers
environment files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from hybridflow.utils.errors import UserError


def exec_file(file: Path, name: str, what: str) -> ModuleType:
    """Execute ``file`` as the module ``name`` once per process (a second call returns the first's module).

    The module is in ``sys.modules`` while its code runs, so code that looks itself up (dataclasses, pickling
    of classes it defines, a framework importing it by name) finds it; a failure removes it again and raises
    ``UserError`` naming ``what`` (the setting and value that named the file)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded  # its registrations and state stay as they are
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise UserError(f"{what}: cannot load {file} as Python code; name a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UserError(f"{what}: importing {file} failed ({type(exc).__name__}: {exc})") from exc
    return module
