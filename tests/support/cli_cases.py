"""The command line's bad inputs that the tests know, gathered for the tests/reliability sweep.

A parametrised test whose cases are bad inputs of the command line says so with ``@sweep(to_case)`` above
its ``@pytest.mark.parametrize``: ``to_case(env, **params)`` turns one case's parameters into the argv of
``hybridflow`` and the text its error line must name. The test keeps checking its cases as before; the
sweep (``tests/reliability/test_bad_inputs.py``) also runs every one of them through ``main`` and asserts
exit status 2, no traceback, and an ``error:`` line naming the field or file. New user-facing inputs join
the sweep by tagging their test, in any test module (``discover`` finds the tagged modules).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.models import build_tiny_model_and_tokenizer

TESTS = Path(__file__).resolve().parents[1]
TAG = "@cli_cases.sweep("
Case = Callable[["Env"], tuple[list[str], str]]

# Key -> (the case's builder, the marks of its parameter set: a skipif holds in the sweep too).
SWEPT: dict[str, tuple[Case, tuple[Any, ...]]] = {}


class Env:
    """What a case may use: a tiny model, a run directory with one checkpoint, its own empty folder."""

    def __init__(self, model: Path, trained: Callable[[], Path], tmp: Path) -> None:
        self.model, self._trained, self.tmp = model, trained, tmp

    def trained(self) -> Path:
        """The shared run directory holding global_step_1 (copy it before damaging anything)."""
        return self._trained()

    def prompts(self, text: bytes = b'{"prompt": "1+1="}\n', name: str = "p.jsonl") -> Path:
        (self.tmp / name).write_bytes(text)
        return self.tmp / name

    def generate(self, model: Path, prompts: Path | None = None, *extra: str) -> list[str]:
        prompts = prompts or self.prompts()
        return [
            "generate",
            "--model",
            str(model),
            "--prompts",
            str(prompts),
            "--out",
            str(self.tmp / "o"),
            *extra,
        ]


def sweep(to_case: Callable[..., tuple[list[str], str]]) -> Callable[[Callable], Callable]:
    """Register every case of the parametrised test below as a bad input of the command line."""

    def register(test: Callable) -> Callable:
        (mark,) = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        for i, value in enumerate(values):
            if hasattr(value, "marks"):  # pytest.param(...)
                params, marks = value.values, value.marks
            else:
                params, marks = (value if len(names) > 1 else (value,)), ()
            kwargs = dict(zip(names, params, strict=True))
            key = f"{Path(sys.modules[test.__module__].__file__).stem}::{test.__name__}[{i}]"
            SWEPT[key] = ((lambda env, kw=kwargs: to_case(env, **kw)), tuple(marks))
        return test

    return register


def discover() -> dict[str, tuple[Case, tuple[Any, ...]]]:
    """Import every test module that tags a test with ``sweep`` (as pytest would) and return the cases."""
    for path in sorted(TESTS.rglob("test_*.py")):
        if TAG not in path.read_text(encoding="utf-8"):
            continue
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))  # pytest's prepend import mode: the same module object
        importlib.import_module(path.stem)
    return dict(SWEPT)


def config_show(env: Env, args: list[str], message: str) -> tuple[list[str], str]:
    """``hybridflow config show ARGS``; the first line of ``message`` without its ``error:`` prefix."""
    return ["config", "show", *args], message.splitlines()[0].removeprefix("error: ")


def tiny_model(folder: Path) -> Path:
    """A tiny Qwen2 and its tokenizer saved to ``folder``."""
    build_tiny_model_and_tokenizer(out_dir=folder, hidden_size=32, num_hidden_layers=1)
    return folder
