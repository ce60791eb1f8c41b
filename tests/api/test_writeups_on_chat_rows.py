"""Issue 38's acceptance: the HybridFlow write-ups' notebook call and step-wise loop, as written, on rows shaped
like HuggingFaceH4/ultrachat_200k (``prompt``, ``prompt_id``, ``messages``: user turns of about 68 and 444-474
characters, multi-turn rows, the Chinese row), as a list of dicts and as a ``datasets.Dataset``, with the
hybrid engine and the baseline. Only the lengths are cut short (responses of 8 tokens) to keep it fast; the
prompt length is the API's own, sized from the data.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support.chat_rows import as_dataset, ultrachat_rows

import hybridflow
from hybridflow.models import build_tiny_model_and_tokenizer

SHORT = ["data.max_response_length=8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("writeups") / "my-model"
    # 1024 positions: the longest multi-turn rows and a response fit; extra_chars: the Chinese row's characters
    rows = ultrachat_rows()
    chars = "".join(sorted({c for r in rows for m in r["messages"] for c in m["content"] if ord(c) > 127}))
    build_tiny_model_and_tokenizer(
        out_dir=out, hidden_size=32, num_hidden_layers=1, max_position_embeddings=1024, extra_chars=chars
    )
    return out


def _dataset(form: str):
    return ultrachat_rows() if form == "list" else as_dataset(ultrachat_rows())


@pytest.mark.parametrize("form", ["list", "Dataset"])
@pytest.mark.parametrize("use_3d_hybrid", [True, False], ids=["hybrid", "baseline"])
def test_the_notebook_call(
    model_dir: Path, tmp_path: Path, monkeypatch, form: str, use_3d_hybrid: bool
) -> None:
    monkeypatch.chdir(tmp_path)  # the run directory goes under runs/hybridflow/ here
    small_dataset = _dataset(form)
    trainer = hybridflow.RLTrainer(
        model_name=str(model_dir), reward_fn=lambda x: 1.0 if "Transformer" in x else 0.5,
        max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=4,
        learning_rate=1e-6, use_3d_hybrid=use_3d_hybrid, overrides=SHORT,
    )  # fmt: skip
    history = trainer.train(small_dataset)
    assert len(history) == 1 and all(math.isfinite(v) for v in history[0].values())
    assert history[0]["critic/score/mean"] == 0.5 and history[0]["response_length/mean"] > 0
    assert trainer.cfg.actor.hybrid_engine is use_3d_hybrid
    assert trainer.cfg.data.max_prompt_length >= 444  # sized from the long user turns, not the default 128
    assert (trainer.run_dir / "final_model" / "model.safetensors").exists()
    assert trainer.run_dir.name.startswith("my-model-")


@pytest.mark.parametrize(("form", "use_3d_hybrid"), [("list", True), ("Dataset", False)])
def test_the_step_wise_loop(
    model_dir: Path, tmp_path: Path, monkeypatch, form: str, use_3d_hybrid: bool
) -> None:
    monkeypatch.chdir(tmp_path)
    prompts = _dataset(form)

    def fn(x):
        return 1.0 if "Transformer" in x else float(len(x) % 2)

    overrides = [*SHORT, "rollout.n=2"]  # 8 prompts x 2 samples a step
    trainer = hybridflow.Trainer(
        actor_model=str(model_dir), critic_model=str(model_dir), reward_fn=fn,
        use_3d_hybrid=use_3d_hybrid, overrides=overrides,
    )  # fmt: skip
    for step in range(2):
        responses = trainer.generate(prompts)  # the rollout stage
        rewards = trainer.critic_score(responses)  # the reward stage (+ the critic's values)
        metrics = trainer.update_actor(responses, rewards)  # log-probs, advantages, critic and actor updates
        assert len(responses) == 16 and rewards.values is not None and trainer.global_step == step + 1
        assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["critic/vf_loss"])
    path = trainer.save()
    trainer.close()
    assert path.name == "global_step_2" and trainer.cfg.actor.hybrid_engine is use_3d_hybrid
    assert trainer.run_dir.parent == Path("runs/hybridflow")
