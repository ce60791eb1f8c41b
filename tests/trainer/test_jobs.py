"""Jobs: ``hybridflow sft`` runs like RL (a run directory with its lock, metrics with the stage timings,
checkpoints, a resume after a kill that continues exactly); eval runs in one process and refuses several ranks.

SFT on several ranks and on Ray equals one rank: tests/trainer/test_multi_rank.py, tests/workers/test_ray_group.py.
"""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
from support.dist_util import run_world_kept as run_world
from support.ray_util import clean_env
from support.realistic import sft_rows, write_jsonl
from support.sft_util import assert_same_sft, sft_argv, step_metrics

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.utils.dirlock import lock_run_dir
from hybridflow.utils.faults import KILL_ENV
from hybridflow.utils.storage import staging_path


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny model and a JSONL of SFT rows of different lengths (tool conversations among them)."""
    root = tmp_path_factory.mktemp("sft")
    build_tiny_model_and_tokenizer(out_dir=root / "model", hidden_size=32, num_hidden_layers=1)
    return root / "model", write_jsonl(sft_rows(8, seed=2), root / "sft.jsonl")


# Four steps over two epochs of two batches, a warm-up and a cosine schedule: the sampler's place, the
# optimizer's moments and the scheduler all have to come back for the resumed steps to equal these.
RESUMABLE = (
    "trainer.total_training_steps=4",
    "trainer.save_freq=2",
    "actor.optim.lr_scheduler_type=cosine",
    "actor.optim.lr_warmup_steps=2",
)


def test_a_killed_sft_run_resumes_where_it_was(tmp_path: Path, sft_setup: tuple[Path, Path]) -> None:
    """Killed at the start of step 4 (step 3 done, its checkpoint not), the run resumes from step 2's checkpoint
    and ends with the steps, metrics lines and weights of an uninterrupted run; every step's line holds the
    dataflow's stage timings; the run directory and the model directory hold what they should."""
    model, data = sft_setup
    straight = tmp_path / "straight"
    assert main(sft_argv(model, data, straight, 1, *RESUMABLE)) == 0
    run = tmp_path / "run"
    argv = sft_argv(model, data, run, 1, *RESUMABLE)
    env = clean_env(**{KILL_ENV: "step_start:4"})  # without this process's process-group variables
    cmd = [sys.executable, "-m", "hybridflow.cli.main", *argv]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(step_metrics(run)) == [1, 2, 3] and not (run / "sft_model").exists()
    assert (run / "global_step_2").is_dir() and not (run / "global_step_3").exists()
    assert main(argv) == 0
    assert_same_sft(straight, run)
    assert (
        len((run / "metrics.jsonl").read_text().splitlines()) == 4
    )  # step 3's line from before the kill was replaced, not repeated
    for metrics in step_metrics(run).values():
        assert metrics["timing_s/collate"] >= 0 and metrics["timing_s/update_actor"] > 0
        assert metrics["perf/total_num_tokens"] > 0
    assert {"config.yaml", "metrics.jsonl", "curves.png", "global_step_4"} <= {p.name for p in run.iterdir()}
    out = {p.name for p in (run / "sft_model").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "sft_config.yaml", "metrics.jsonl"} <= out
    assert (run / "sft_model" / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()


def test_sft_refuses_a_locked_run_directory_a_batch_the_replicas_cannot_split_and_val_only(
    tmp_path: Path, sft_setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, data = sft_setup
    run = tmp_path / "run"
    run.mkdir()
    with lock_run_dir(run):  # another run holds it
        assert main(sft_argv(model, data, run, 1)) == 2
    assert f"trainer.default_local_dir {run} is in use by another run" in capsys.readouterr().err
    assert not (run / "config.yaml").exists()
    # two ranks of FSDP2 get 3 rows each of a batch of 6 ... but 3 rows of a batch of 3 cannot split in two
    odd = (
        "data.train_batch_size=3",
        "actor.ppo_mini_batch_size=3",
        "rollout.n=2",
        "actor.ppo_micro_batch_size_per_gpu=1",
    )
    assert main(sft_argv(model, data, tmp_path / "odd", 2, *odd)) == 2
    err = capsys.readouterr().err
    assert "data.train_batch_size=3 rows do not split over the actor's 2 data-parallel replicas" in err, err
    assert main(sft_argv(model, data, tmp_path / "val", 1, "trainer.val_only=true")) == 2
    assert "trainer.val_only=true: hybridflow sft trains and does not validate" in capsys.readouterr().err
    assert not (tmp_path / "val").exists()  # refused before any work


def test_a_full_disk_at_the_sft_model_keeps_the_old_one_and_names_the_checkpoint(
    tmp_path: Path,
    sft_setup: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--overwrite`` of a model directory when the disk fills while writing the new model: one line naming
    ``--out`` and the checkpoint that holds the trained weights; the old directory is as it was."""
    import hybridflow.workers.rank as rank_module

    model, data = sft_setup
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("mine\n")

    def full_disk(state, config, files, out_dir, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(out_dir) / "model.safetensors"))

    monkeypatch.setattr(rank_module, "save_hf_model", full_disk)
    code = main([*sft_argv(model, data, tmp_path / "run"), "--out", str(out), "--overwrite"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, errors
    assert f"the disk is full: writing the SFT model to {out} failed" in errors[0]
    assert f"the checkpoint {tmp_path / 'run' / 'global_step_2'} holds the trained weights" in errors[0]
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "mine\n"
    assert not staging_path(out).exists()


def eval_on_a_rank(rank: int, tmp: str) -> tuple[int, str]:
    import contextlib
    import io

    config = Path(tmp) / "empty.yaml"
    config.write_text("{}\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        ev = main(["eval", str(config), "model.path=/nowhere", "--out", f"{tmp}/e{rank}.jsonl"])
    return ev, err.getvalue()


def test_eval_refuses_several_ranks(tmp_path: Path) -> None:
    results = run_world(2, eval_on_a_rank, str(tmp_path))
    for ev, err in results:
        assert ev == 2
        assert "hybridflow eval runs in one process" in err and "without torchrun" in err
    assert not list(tmp_path.glob("e*.jsonl"))  # refused before any work
