import threading

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


def overlapping_flow(seen: list, fail: bool = False) -> Dataflow:
    """reward runs in the background and waits for old_log_prob to have started: it can only finish when
    the two run at the same time (each side waits at most 20 s, then the test fails instead of hanging)."""
    started = threading.Event()

    def reward(batch, metrics):
        assert started.wait(20), "the background stage never saw the foreground one run beside it"
        metrics["reward_extra/score/mean"] = 0.5
        if fail:
            raise ValueError("row 3: the reward function returned 'abc'")
        seen.append(("reward", threading.current_thread().name, sorted(batch.keys())))
        return Batch({"scores": batch["x"].sum(-1, keepdim=True)})

    def old_log_prob(batch, metrics):
        started.set()
        seen.append(("old_log_prob", threading.current_thread().name, sorted(batch.keys())))
        return Batch({"old": torch.ones(len(batch), 4)})

    return Dataflow(
        [
            Stage("reward", ("x", "label"), ("scores",), reward, background=True),
            Stage("old_log_prob", ("x",), ("old",), old_log_prob),
            stage("adv", ["scores", "old"], ["advantages"]),
        ],
        inputs=["x", "label"],
    )


def test_a_background_stage_runs_beside_the_next_ones_and_is_joined_by_its_first_reader() -> None:
    seen, metrics = [], {}
    batch = Batch({"x": torch.full((3, 4), 2.0), "label": torch.zeros(3)})
    out = overlapping_flow(seen).run(batch, metrics)
    assert [s[0] for s in seen] == ["old_log_prob", "reward"]
    assert seen[0][1] == threading.main_thread().name and seen[1][1].startswith("dataflow")
    assert seen[1][2] == ["label", "x"]  # its own copy: old_log_prob dropped x meanwhile
    assert sorted(out.keys()) == ["advantages"]  # label, read last by reward, went at the join
    assert metrics["reward_extra/score/mean"] == 0.5  # the stage's own metrics are merged
    assert metrics["timing_s/reward"] > 0 and metrics["timing_s/reward_wait"] >= 0
    assert metrics["perf/lifecycle_freed_bytes"] > 0


def test_a_failing_background_stage_raises_in_the_step() -> None:
    batch = Batch({"x": torch.ones(3, 4), "label": torch.zeros(3)})
    with pytest.raises(ValueError, match="row 3: the reward function returned 'abc'"):
        overlapping_flow([], fail=True).run(batch, {})


def test_a_background_stage_cannot_replace_the_batch() -> None:
    with pytest.raises(ValueError, match="background stage cannot replace the batch"):
        Stage("gen", ("x",), ("y",), lambda b, m: None, replaces_batch=True, background=True)


def test_the_docs_dataflow_of_your_own_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "dataflow.md").read_text()
    section = doc[doc.index("## A dataflow of your own") : doc.index("## A stage in a training run")]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    scope: dict = {}
    exec(compile(code, "docs/dataflow.md", "exec"), scope)
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["['gen', 'reward', 'shape', 'update']", "['loss']"]  # what its comments say
    # responses [p, p + 1] of 4 tokens: mean token (2, 4, 6) less a 0.4 length penalty, the loss its negative
    assert torch.allclose(scope["out"]["loss"], torch.tensor([-1.6, -3.6, -5.6]))
    metrics = scope["metrics"]
    assert metrics["actor/loss"] == pytest.approx(-3.6)
    assert {f"timing_s/{s}" for s in ("gen", "reward", "shape", "update")} <= set(metrics)
    assert metrics["perf/lifecycle_freed_bytes"] > 0
