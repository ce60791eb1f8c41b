"""Run directories of the notebook API (issue 38): every run gets its own, and a run resumes only when the
user asks for it or names the directory, so that re-running a cell, or running it with another model of the
same shape (and the same directory name), never leaves another run's weights in ``final_model``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hybridflow
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.utils.errors import UserError

ROWS = [{"prompt": [{"role": "user", "content": "count to " + "ten " * k}]} for k in range(1, 5)]
SMALL = dict(num_generations=2, per_device_train_batch_size=8, gradient_accumulation_steps=1)
SHORT = ["data.max_response_length=6"]


def varied(text):
    """Scores that differ within a group, so that a learning rate above zero moves the weights."""
    return float(len(text) % 3) / 2


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(model: Path, lr: float, max_steps: int = 1, resume=None, **keywords) -> tuple:
    trainer = hybridflow.RLTrainer(
        model_name=str(model), reward_fn=varied, max_steps=max_steps, learning_rate=lr, overrides=SHORT,
        **SMALL, **keywords,
    )  # fmt: skip
    return trainer, trainer.train(ROWS, resume_from_checkpoint=resume)


@pytest.fixture
def models(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """Two models of one shape in directories of one name, and a working directory for runs/."""
    monkeypatch.chdir(tmp_path)
    first, second = tmp_path / "a" / "model", tmp_path / "b" / "model"
    build_tiny_model_and_tokenizer(out_dir=first, hidden_size=32, num_hidden_layers=1, seed=0)
    build_tiny_model_and_tokenizer(out_dir=second, hidden_size=32, num_hidden_layers=1, seed=1)
    return first, second


def test_rerunning_the_cell_never_reuses_the_wrong_weights(models: tuple[Path, Path]) -> None:
    first, second = models
    a, history = run(first, 1e-3)
    assert len(history) == 1 and a.run_dir.parent == Path("runs/hybridflow")
    assert a.run_dir.name.startswith("model-") and not same(
        weights(a.run_dir / "final_model"), weights(first)
    )

    b, history = run(first, 0.0)  # the same cell again: a fresh run (lr 0 must give back its input)
    assert len(history) == 1 and b.run_dir != a.run_dir
    assert same(weights(b.run_dir / "final_model"), weights(first))

    c, history = run(second, 0.0)  # another model of the same shape and directory name
    assert len(history) == 1 and c.run_dir not in (a.run_dir, b.run_dir)
    final = weights(c.run_dir / "final_model")
    assert same(final, weights(second)) and not same(final, weights(a.run_dir / "final_model"))

    # Asked for: the newest run of this model (b's, not c's of the other model) continues in its directory.
    d, history = run(first, 0.0, max_steps=2, resume=True)
    assert d.run_dir == b.run_dir and [h["training/global_step"] for h in history] == [2.0]
    assert same(weights(d.run_dir / "final_model"), weights(first))


def test_a_named_directory_resumes_and_false_starts_afresh(models: tuple[Path, Path]) -> None:
    first, _ = models
    with pytest.raises(
        UserError, match=r"resume_from_checkpoint=True: no run of model under runs/hybridflow/"
    ):
        run(first, 0.0, resume=True)
    with pytest.raises(UserError, match=r"resume_from_checkpoint=True: the run directory mine holds no"):
        run(first, 0.0, resume=True, output_dir="mine")
    _, history = run(first, 0.0, output_dir="mine")
    assert len(history) == 1 and (Path("mine") / "global_step_1").is_dir()
    _, history = run(first, 0.0, output_dir="mine")  # pointed at it again: resumed, complete already
    assert history == []
    _, history = run(first, 0.0, output_dir="mine", resume=False)  # asked for a fresh start
    assert len(history) == 1
    with pytest.raises(UserError, match=r"resume_from_checkpoint=True and trainer.resume are both set"):
        hybridflow.RLTrainer(model_name=str(first), overrides=["trainer.resume=auto"]).train(
            ROWS, resume_from_checkpoint=True
        )
    with pytest.raises(
        UserError, match=r"output_dir='mine' sets trainer.default_local_dir=.*but overrides set"
    ):
        hybridflow.RLTrainer(
            model_name=str(first), output_dir="mine", overrides=["trainer.default_local_dir=other"]
        )
