"""``hybridflow train`` with ``rollout.harness``: a step whose episodes are played by a user's harness over
the endpoint. Episodes that raise cost only themselves (the run exits 0, ``harness/errors`` counts them), an
episode that rewrites its history trains on two rows, and the rollout's log-probs equal the trainer's
recomputation on every trained token (float32, 1e-5) with ppo_kl 0 on the first (on-policy) step."""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.cli.main import main
from hybridflow.models.tiny import build_tiny_model_and_tokenizer

HARNESS = """
async def episode(client, row):
    index = row["extra_info"]["index"]
    if index % 4 == 1:
        raise ValueError("this episode's harness fails")
    messages = [dict(m) for m in row["raw_prompt"]]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "tool", "content": "7"}]
    if index % 4 == 2:  # a summarising harness: the second request no longer holds the first turn
        messages = [{"role": "user", "content": "summary: " + row["raw_prompt"][0]["content"]}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return float(index % 2), {"turns": 2.0}
"""


def test_grpo_step_through_a_harness(tmp_path: Path) -> None:
    build_tiny_model_and_tokenizer(tmp_path / "model", hidden_size=32, num_hidden_layers=1)
    (tmp_path / "harness.py").write_text(HARNESS)
    run = tmp_path / "run"
    code = main([
        "train", f"model.path={tmp_path / 'model'}", "data.task=multiply", f"rollout.harness.module={tmp_path / 'harness.py'}",
        "data.train_batch_size=8", "rollout.n=2", "actor.ppo_mini_batch_size=8", "data.max_response_length=32",
        "data.shuffle=false", "trainer.total_training_steps=1", "trainer.device=cpu", "trainer.logger=[console]",
        "trainer.test_freq=0", "trainer.val_before_train=false", f"trainer.default_local_dir={run}",
        f"trainer.rollout_data_dir={run / 'rollouts'}", "trainer.save_freq=0", "trainer.resume=disable",
    ])  # fmt: skip
    assert code == 0
    (m,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert m["harness/episodes"] == 16 and m["harness/errors"] == 4  # rows 1 and 5 of 8, twice each
    assert m["harness/splits"] == 4 and m["harness/turns/mean"] == 2.0
    assert m["rollout_corr/log_prob_abs_diff_max"] <= 1e-5 and m["actor/ppo_kl"] == 0.0
    records = [json.loads(line) for line in (run / "rollouts" / "1.jsonl").read_text().splitlines()]
    # 12 episodes that ran, 4 of them split in two; the 4 that raised kept nothing (they sampled nothing)
    assert len(records) == 16
