"""``trainer.deterministic``: two runs with the same seed give the same metrics, step for step (CPU and GPU).

Each run is a child process: the switch is global to a process (torch's deterministic algorithms, cuBLAS's
workspace), so it must not leak into the test process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_checkpointing import VOLATILE, argv, start_cli

from hybridflow.models import build_tiny_model_and_tokenizer

# Memory figures depend on the allocator's history, not on the numbers computed.
UNCOMPARED = (*VOLATILE, "memory/", "perf/")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=2)
    return out


def run_twice(model_dir: Path, tmp_path: Path, steps: int, *extra: str) -> list[list[dict]]:
    """The metrics rows of two identical ``hybridflow train`` runs, each in a child process."""
    runs = []
    for k in range(2):
        run_dir = tmp_path / f"run{k}"
        log = tmp_path / f"run{k}.log"
        args = argv(model_dir, run_dir, f"trainer.total_training_steps={steps}", "trainer.deterministic=true")
        proc = start_cli([*args, "trainer.save_freq=0", *extra], log)
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        assert "trainer.deterministic: deterministic kernels" in log.read_text()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs.append([{k: v for k, v in r.items() if not k.startswith(UNCOMPARED)} for r in rows])
    return runs


def test_two_deterministic_runs_log_the_same_metrics_on_cpu(model_dir: Path, tmp_path: Path) -> None:
    first, second = run_twice(model_dir, tmp_path, 2, "trainer.device=cpu")
    assert len(first) == 2 and first == second
    assert first[0]["actor/pg_loss"] != first[1]["actor/pg_loss"]  # the steps differ: the runs did learn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_deterministic_runs_log_the_same_metrics_on_the_gpu(model_dir: Path, tmp_path: Path) -> None:
    # Compiled training, CUDA graphs and the fused sampler: the default GPU path, five steps.
    first, second = run_twice(model_dir, tmp_path, 5, "rollout.dtype=bfloat16")
    assert len(first) == 5 and first == second
