"""Harness episodes on the endpoint: a harness that raises, hangs, sends a malformed request or returns no
reward costs only its own episode (counted per kind; reward 0 or dropped per ``on_error``), while the others
score; a harness module is checked when loaded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hybridflow.serve.harness import HarnessRunner, harness_metrics, load_harness
from hybridflow.utils.errors import UserError


async def mixed(client, row):
    """Each row's ``kind`` picks what the episode does."""
    kind = row["kind"]
    if kind == "raise":
        raise RuntimeError("the harness has a bug")
    if kind == "hang":
        await asyncio.sleep(60)
    if kind == "malformed":
        await client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])
    reply = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    if kind == "no_reward":
        return "great"
    return 1.0, {"chars": float(len(reply.choices[0].message.content or ""))}


@pytest.mark.parametrize("on_error", ["zero", "drop"])
def test_a_failing_harness_costs_only_its_episode(served, on_error: str) -> None:
    served.stop.set()  # the runner drives the engine on this thread, as the trainer's rollout does
    served.thread.join(timeout=30)
    try:
        kinds = ["ok", "raise", "hang", "ok", "malformed", "no_reward"]
        # the timeout leaves the good episodes room on a loaded machine (2 s failed beside other jobs)
        runner = HarnessRunner(mixed, max_concurrency=4, timeout_s=6.0, on_error=on_error)
        done = []
        results = runner.run(served.endpoint, [{"kind": k} for k in kinds], done.append)
    finally:
        served.stop.clear()
        served.thread = __import__("threading").Thread(
            target=served.endpoint.driver.run_until, args=(served.stop.is_set,), daemon=True
        )
        served.thread.start()
    assert len(done) == len(kinds)
    assert [r.failure for r in results] == [None, "error", "timeout", None, "error", "bad_reward"]
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert all(len(results[i].sequences) == 1 for i in (0, 3))
    kept = len(results[5].sequences)  # it sampled an answer before returning no reward
    assert kept == (1 if on_error == "zero" else 0)
    m = harness_metrics(results)
    assert (m["harness/errors"], m["harness/timeouts"], m["harness/bad_rewards"]) == (2, 1, 1)
    assert m["harness/chars/mean"] >= 0 and not served.endpoint.episodes  # every episode closed


def test_harness_modules_are_checked_when_loaded(tmp_path: Path) -> None:
    path = tmp_path / "h.py"
    path.write_text(
        "def episode(client, row):\n    return 1.0\n\nasync def play(client, row):\n    return 1.0\n"
    )
    assert load_harness(str(path), "play").__name__ == "play"
    with pytest.raises(UserError, match="must be an async function"):
        load_harness(str(path), "episode")
    with pytest.raises(UserError, match="its async functions: play"):
        load_harness(str(path), "missing")
    with pytest.raises(UserError, match=r"rollout\.harness\.module"):
        load_harness(str(tmp_path / "absent.py"), "episode")
    with pytest.raises(UserError, match="on_error"):
        HarnessRunner(None, 1, 1.0, "ignore")
