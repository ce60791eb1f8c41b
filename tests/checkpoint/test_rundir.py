"""The run directory: complete vs interrupted checkpoints, the latest marker, atomic replacement, pruning."""

from __future__ import annotations

from pathlib import Path

from hybridflow.checkpoint import rundir


def make_checkpoint(run: Path, step: int, complete: bool = True) -> Path:
    """A checkpoint folder by hand: a payload file, and meta.json when complete."""
    path = rundir.temp_dir(run, step)
    path.mkdir(parents=True)
    (path / "payload").write_text(str(step))
    if complete:
        (path / rundir.META_FILE).write_text("{}")
        rundir.commit(path, rundir.step_dir(run, step))
        return rundir.step_dir(run, step)
    return path


def test_latest_is_the_marked_complete_checkpoint(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4)
    assert rundir.read_latest_marker(tmp_path) == 4
    assert rundir.find_latest(tmp_path) == rundir.step_dir(tmp_path, 4)
    assert [s for s, _ in rundir.complete_checkpoints(tmp_path)] == [2, 4]


def test_interrupted_saves_are_never_picked(tmp_path: Path, caplog) -> None:
    make_checkpoint(tmp_path, 2)
    tmp = make_checkpoint(tmp_path, 4, complete=False)  # killed before meta.json / the rename
    broken = rundir.step_dir(tmp_path, 6)  # a step folder without meta.json (e.g. copied by hand)
    broken.mkdir()
    assert rundir.find_latest(tmp_path) == rundir.step_dir(tmp_path, 2)
    assert rundir.incomplete_saves(tmp_path) == [tmp, broken]
    assert "interrupted" in caplog.text


def test_marker_pointing_at_a_missing_checkpoint_falls_back_to_the_newest(tmp_path: Path, caplog) -> None:
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 3)
    (tmp_path / rundir.LATEST_FILE).write_text("7\n")
    assert rundir.find_latest(tmp_path) == rundir.step_dir(tmp_path, 3)
    assert "step 7" in caplog.text
    assert rundir.find_latest(tmp_path / "nowhere") is None


def test_commit_replaces_an_older_checkpoint_of_the_same_step(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 5)
    tmp = rundir.temp_dir(tmp_path, 5)
    tmp.mkdir()
    (tmp / "payload").write_text("new")
    (tmp / rundir.META_FILE).write_text("{}")
    rundir.commit(tmp, rundir.step_dir(tmp_path, 5))
    assert (rundir.step_dir(tmp_path, 5) / "payload").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_5", rundir.LATEST_FILE]


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        make_checkpoint(tmp_path, step)
    removed = rundir.prune(tmp_path, 2)
    assert [p.name for p in removed] == ["global_step_1", "global_step_2"]
    assert [s for s, _ in rundir.complete_checkpoints(tmp_path)] == [3, 4]
    assert rundir.prune(tmp_path, None) == []


def test_remove_stale_temp_leaves_complete_checkpoints(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2, complete=False)
    rundir.remove_stale_temp(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", rundir.LATEST_FILE]
