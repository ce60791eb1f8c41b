"""``rollout.harness.verifiers_env``: GRPO through a ``verifiers`` environment (``examples/agents/
verifiers_arithmetic.py``: verifiers' own Taskset, Task rubric and Harness classes). Its harness talks to the
endpoint through verifiers' interception server; its rubric gives the reward (the weighted sum of ``correct``
and ``formatted``) and the metrics; the rollout's log-probs equal the trainer's recomputation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridflow.cli.main import main
from hybridflow.models.tiny import build_tiny_model_and_tokenizer
from hybridflow.serve.verifiers_env import VerifiersEnv
from hybridflow.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agents" / "verifiers_arithmetic.py"


def taught_model(path: Path) -> None:
    """A tiny model that has learnt to reply in the rubric's format (``#### <number>``), to both turns."""
    model, tokenizer = build_tiny_model_and_tokenizer(None, hidden_size=32, num_hidden_layers=1, seed=2)
    lessons = [
        [
            {"role": "user", "content": f"What is {a} + {b}? Answer as #### <number>."},
            {"role": "assistant", "content": f"#### {a + b}"},
            {"role": "user", "content": "Sure? Reply #### <number>."},
            {"role": "assistant", "content": f"#### {a + b}"},
        ]
        for a, b in [(3, 4), (12, 9)]
    ]
    ids = [
        torch.tensor([tokenizer.apply_chat_template(m, tokenize=True, return_dict=False)]) for m in lessons
    ]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for step in range(60):
        x = ids[step % len(ids)]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_grpo_through_a_verifiers_environment(tmp_path: Path) -> None:
    taught_model(tmp_path / "model")
    run = tmp_path / "run"
    code = main([
        "train", f"model.path={tmp_path / 'model'}", "data.task=arithmetic", "data.task_kwargs.style=question",
        f"rollout.harness.verifiers_env={EXAMPLE}", "data.train_batch_size=2", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4", "data.max_response_length=112", "data.shuffle=false",
        "trainer.total_training_steps=2", "trainer.device=cpu", "trainer.logger=[console]", "trainer.test_freq=0",
        "trainer.val_before_train=false", f"trainer.default_local_dir={run}", "trainer.save_freq=0",
        f"trainer.rollout_data_dir={run / 'rollouts'}", "trainer.resume=disable",
    ])  # fmt: skip
    assert code == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:
        # 2 prompts x 2 episodes, each two requests (the answer, then the check) continuing one sequence
        assert m["harness/episodes"] == 4 and m["harness/errors"] == 0
        assert m["harness/requests/mean"] == 2.0 and m["harness/splits"] == 0
        # the reward is the rubric's: correct (weight 1) + formatted (weight 0.2)
        rubric = m["harness/reward/correct/mean"] + 0.2 * m["harness/reward/formatted/mean"]
        assert m["harness/reward/mean"] == pytest.approx(rubric)
        assert m["harness/reply_chars/mean"] > 0
        assert m["rollout_corr/log_prob_abs_diff_max"] <= 1e-5
    assert max(m["harness/reward/formatted/mean"] for m in steps) > 0  # the taught format scores
    records = [json.loads(line) for line in (run / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert len(records) == 4
    # each row's score is one of the rubric's sums (float32 in the records)
    assert all(any(r["score"] == pytest.approx(v) for v in (0.0, 0.2, 1.0, 1.2)) for r in records)


def test_a_row_becomes_the_environments_task() -> None:
    env = VerifiersEnv(str(EXAMPLE), {})
    row = {
        "raw_prompt": [{"role": "user", "content": "What is 2 + 2? Answer as #### <number>."}],
        "ground_truth": "4",
        "extra_info": {"index": 3, "split": "train"},
    }
    task = env.task(row)
    assert type(task).__name__ == "ArithmeticTask"
    assert task.data.answer == "4" and task.data.prompt_text == row["raw_prompt"][0]["content"]
    # a field of the task's data in extra_info wins over ground_truth
    assert env.task({**row, "extra_info": {"answer": "5"}}).data.answer == "5"


def test_the_environments_config_errors_name_the_key() -> None:
    with pytest.raises(
        UserError, match=r"rollout\.harness\.verifiers_env='no_such_env_xyz' is not a verifiers"
    ):
        VerifiersEnv("no_such_env_xyz", {})
    with pytest.raises(UserError, match=r"rollout\.harness\.verifiers_config: the environment refused it"):
        VerifiersEnv(str(EXAMPLE), {"agent": {"max_turns": "many"}})
    with pytest.raises(UserError, match=r"verifiers_config\.taskset\.id='other' differs"):
        VerifiersEnv(str(EXAMPLE), {"taskset": {"id": "other"}})
    with pytest.raises(
        UserError, match=r"verifiers_config\.agent\.retries\.max_retries=2: a retried attempt"
    ):
        VerifiersEnv(str(EXAMPLE), {"agent": {"retries": {"max_retries": 2}}})
    with pytest.raises(UserError, match=r"no such file"):
        VerifiersEnv("missing_env.py", {})


def test_without_verifiers_the_error_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "verifiers" else find_spec(n, *a)
    )
    with pytest.raises(
        UserError, match=r"rollout\.harness\.verifiers_env needs the verifiers package.*pip install"
    ):
        VerifiersEnv(str(EXAMPLE), {})
