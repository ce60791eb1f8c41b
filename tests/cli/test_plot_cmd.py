"""``hybridflow plot``: one run or several from their metrics.jsonl; a missing or empty run is a user error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.image import imread
from support import cli_cases

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


GOOD = b'{"step": 1, "critic/score/mean": 0.5}\n{"step": 2, "critic/score/mean": 0.6}\n'
# (what the file holds, the line its error names): lines that are not JSON are damage, wherever they are
DAMAGED = [
    (GOOD + b"\x8b\x1f\xff\xfe\x00garbage\n" + GOOD, "line 3 is not JSON (binary bytes)"),
    (GOOD + b"\x00" * 300, "line 3 is not JSON (binary bytes)"),  # a tail a power loss left unwritten
    (b"step,reward\n1,0.5\n", "line 1 is not JSON (starts 'step,reward')"),
    (GOOD + b'{"step": 3, "crit\n' + GOOD, "line 3 is not JSON"),  # a torn line inside the file
    (GOOD + b"not json\nnor this\n", "line 3 is not JSON (starts 'not json') (2 damaged lines in all)"),
]


def _damaged_case(env: cli_cases.Env, data: bytes, named: str) -> tuple[list[str], str]:
    run = env.tmp / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_bytes(data)
    return ["plot", str(run)], named


@cli_cases.sweep(_damaged_case)  # the reliability sweep runs these cases too
@pytest.mark.parametrize(("data", "named"), DAMAGED)
def test_a_damaged_metrics_file_exits_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, named: str
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(data)
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{run / 'metrics.jsonl'}: {named}" in errors[0] and "the file is damaged" in errors[0]
    assert "no metrics yet" not in err and not (run / "curves.png").exists()


def test_malformed_rows_are_counted_and_named_and_the_rest_plotted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write(
            '{"no_step": 1}\n[1, 2]\n{"step": "x", "critic/score/mean": 1}\n{"step": 9, "critic/score/mean": 0.9}\n'
        )
    assert main(["plot", str(run)]) == 0
    err = capsys.readouterr().err
    path = run / "metrics.jsonl"
    assert err.splitlines() == [
        f"warning: {path}: 3 lines are not metrics lines, left out: line 6 (no 'step'), line 7 (a JSON list, "
        "not an object), line 8 ('step' is 'x', not a whole number)"
    ]
    assert imread(run / "curves.png").ndim == 3


def test_an_unfinished_last_line_is_a_stopped_run_not_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run killed while writing leaves the start of a line with no newline: plotted, with a warning."""
    run = make_run(tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "critic/score/mean": 0.7, "actor/gra')
    assert main(["plot", str(run)]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"warning: {run / 'metrics.jsonl'}: line 6 is unfinished (the run was stopped while writing it), left out"
    ]
    # the same text followed by a newline is a torn line inside the file: damage
    with (run / "metrics.jsonl").open("a") as f:
        f.write("\n")
    assert main(["plot", str(run)]) == 2
    assert "line 6 is not JSON" in capsys.readouterr().err


def test_a_file_of_only_malformed_rows_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"loss": 1.0}\n')
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("warning: ") and "line 1 (no 'step')" in err[0]
    assert (
        err[1]
        == f"error: {run / 'metrics.jsonl'} holds no metrics yet (no line of it is a metrics line): nothing to plot"
    )
