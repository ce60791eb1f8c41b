"""``import hybridflow``: the lazy names, and the write-ups' names it does not have, pointing to what it has."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_write_ups_hybrid_dataflow_is_an_import_error_pointing_to_the_built_in_dataflow() -> None:
    with pytest.raises(ImportError) as info:
        from hybridflow import HybridDataFlow  # noqa: F401
    message = str(info.value)
    assert message.startswith("hybridflow has no HybridDataFlow (the HybridFlow write-ups' name)")
    assert "hybridflow.trainer.dataflow.Dataflow" in message and "Stage(name, reads, writes, run)" in message
    assert "hybridflow.Trainer" in message and "docs/dataflow.md" in message
    assert (ROOT / "docs" / "dataflow.md").is_file()
    from hybridflow.trainer.dataflow import Dataflow, Stage  # what it names exists under that name

    assert {"name", "reads", "writes", "run"} <= set(Stage.__dataclass_fields__) and callable(Dataflow)


def test_another_missing_name_is_still_an_attribute_error() -> None:
    import hybridflow

    assert not hasattr(hybridflow, "NoSuchThing")
    with pytest.raises(ImportError, match="cannot import name 'NoSuchThing'"):
        from hybridflow import NoSuchThing  # noqa: F401


def test_import_hybridflow_stays_light() -> None:
    probe = "import sys, hybridflow; print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_no_two_test_modules_share_a_name() -> None:
    """pytest's default (prepend) import mode imports test modules by their base name: two files of one name in
    different directories stop the whole run at collection (it happened twice)."""
    root = Path(__file__).resolve().parent
    names: dict[str, list[str]] = {}
    for path in root.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(root)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
