"""Jobs that run in one process refuse to be launched on several ranks (each would repeat the whole job)."""

from __future__ import annotations

from pathlib import Path

from dist_util import run_world_kept as run_world


def sft_then_eval_on_a_rank(rank: int, tmp: str) -> tuple[int, int, str]:
    import contextlib
    import io

    from hybridflow.cli.main import main

    config = Path(tmp) / "empty.yaml"
    config.write_text("{}\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        sft = main(
            [
                "sft",
                "model.path=/nowhere",
                f"trainer.default_local_dir={tmp}/run{rank}",
                "--out",
                f"{tmp}/o{rank}",
            ]
        )
        ev = main(["eval", str(config), "model.path=/nowhere", "--out", f"{tmp}/e{rank}.jsonl"])
    return sft, ev, err.getvalue()


def test_sft_and_eval_refuse_several_ranks(tmp_path: Path) -> None:
    results = run_world(2, sft_then_eval_on_a_rank, str(tmp_path))
    for sft, ev, err in results:
        assert sft == 2 and ev == 2
        assert "hybridflow sft runs in one process, but this is one of 2 ranks" in err
        assert "hybridflow eval runs in one process" in err and "without torchrun" in err
    assert not list(tmp_path.glob("o*")) and not list(tmp_path.glob("run*"))  # refused before any work
