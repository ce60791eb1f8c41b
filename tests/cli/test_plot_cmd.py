"""``hybridflow plot``: one run or several from their metrics.jsonl; a missing or empty run is a user error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from hybridflow.cli.main import main


def make_run(run_dir: Path, steps: int = 6) -> Path:
    run_dir.mkdir(parents=True)
    rows = [
        {"step": s, "critic/score/mean": 0.4 + s / 20, "actor/grad_norm": float(s)} for s in range(1, steps)
    ]
    rows[2]["critic/score/mean"] = None
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_plot_redraws_a_runs_curves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path / "demo")
    assert main(["plot", str(run)]) == 0
    assert imread(run / "curves.png").ndim == 3
    assert f"wrote {run / 'curves.png'}" in capsys.readouterr().out


def test_plot_two_runs_side_by_side(tmp_path: Path) -> None:
    a, b = make_run(tmp_path / "a" / "demo"), make_run(tmp_path / "b" / "demo", steps=4)
    out = tmp_path / "both.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert imread(out).shape[1] >= 1200
    assert not (a / "curves.png").exists()  # --out, not the run's own picture


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "empty_file", "file"])
def test_a_missing_or_empty_run_exits_2_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    run = tmp_path / "run"
    if kind == "empty_dir":
        run.mkdir()
    elif kind == "empty_file":
        run.mkdir()
        (run / "metrics.jsonl").write_text("")
    elif kind == "file":
        run.write_text("not a directory")
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(run) in err and "Traceback" not in err
    assert not (tmp_path / "run" / "curves.png").exists()
