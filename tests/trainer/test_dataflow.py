import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.trainer.dataflow import Dataflow, Stage, order_stages


def stage(name, reads, writes, log=None):
    def run(batch, metrics):
        if log is not None:
            log.append((name, sorted(batch.keys())))
        return Batch({w: torch.ones(len(batch), 4) for w in writes})

    return Stage(name, tuple(reads), tuple(writes), run)


def test_stages_run_in_dependency_order_and_keys_are_freed_after_their_last_reader() -> None:
    log = []
    flow = Dataflow(
        [
            stage("adv", ["scores", "values"], ["advantages"], log),
            stage("values", ["x"], ["values"], log),
            stage("reward", ["x"], ["scores"], log),
            stage("update", ["advantages", "x"], [], log),
        ],
        inputs=["x"],
        keep=["scores"],
    )
    assert flow.names == ["values", "reward", "adv", "update"]
    metrics = {}
    batch = flow.run(Batch({"x": torch.zeros(3, 4)}), metrics)
    # values is read last by adv, so it is gone when update runs; scores is kept for the metrics.
    assert log[-1] == ("update", ["advantages", "scores", "x"])
    assert sorted(batch.keys()) == ["scores"]
    assert metrics["perf/lifecycle_freed_bytes"] == 3 * 4 * 4 * 3  # values, advantages, x (float32)
    assert set(metrics) >= {"timing_s/values", "timing_s/reward", "timing_s/adv", "timing_s/update"}


def test_a_read_nobody_writes_is_reported() -> None:
    with pytest.raises(ValueError, match=r"'adv': \['values'\]"):
        order_stages([stage("adv", ["values"], ["advantages"])], {"x"})
