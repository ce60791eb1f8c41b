"""On the GPU: every command-line job runs end to end on a tiny model (SFT, DPO, KTO, GRPO with a reward
model and offloaded roles, generate).

The CPU suite runs the same jobs, but on CPU nothing moves between devices: these catch a tensor left on the
wrong device, an offloaded role used before it comes back, or a CUDA-only kernel path that a job reaches.
Run on the GPU machine with ``pytest -m gpu tests/trainer``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support.dist_util import run_world
from support.reward_model_util import save_reward_model
from test_preference_job import pairs, rows_of, run, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer

pytestmark = pytest.mark.gpu

EAGER = ["actor.use_torch_compile=false", "critic.use_torch_compile=false"]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=2)
    return out


def finite(rows: list[dict]) -> bool:
    return all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float))


def test_sft_moves_the_weights_and_exports(tmp_path: Path, base_model: Path) -> None:
    rows = [{"prompt": f"{i}+1=", "response": f"#### {i + 1}"} for i in range(8)]
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    out = tmp_path / "sft_model"
    assert run("sft", tmp_path, base_model, data, *EAGER, "--out", str(out)) == 0
    base = dict(AutoModelForCausalLM.from_pretrained(base_model).named_parameters())
    tuned = AutoModelForCausalLM.from_pretrained(out)
    assert any(not p.equal(base[n]) for n, p in tuned.named_parameters())
    assert finite(rows_of(out))


@pytest.mark.parametrize("offload", [False, True])
def test_dpo_and_kto_train_with_the_reference_on_or_off_the_device(
    tmp_path: Path, base_model: Path, offload: bool
) -> None:
    flags = [*EAGER, f"ref.fsdp.param_offload={str(offload).lower()}"]
    if offload:
        flags += ["actor.fsdp.param_offload=true", "actor.fsdp.optimizer_offload=true"]
    dpo = tmp_path / "dpo"
    dpo.mkdir()
    assert run("dpo", dpo, base_model, write_jsonl(dpo / "pairs.jsonl", pairs(8)), *flags) == 0
    metrics = rows_of(dpo / "run")
    assert metrics[0]["loss"] == pytest.approx(0.6931472, abs=1e-4)  # the policy starts as the reference
    assert metrics[1]["rewards/margins"] != 0.0 and finite(metrics)

    kto = tmp_path / "kto"
    kto.mkdir()
    rows = [{"prompt": f"{i}+1=", "completion": f"{i + 1 + (i % 2)}", "label": i % 2 == 0} for i in range(8)]
    assert run("kto", kto, base_model, write_jsonl(kto / "kto.jsonl", rows), *flags) == 0
    metrics = rows_of(kto / "run")
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-4) and finite(metrics)


def grpo_with_reward_model(model: Path, tmp_path: Path, *extra: str) -> list[str]:
    """``hybridflow train`` arguments: GRPO with a KL loss scored by a fresh tiny reward model, 2 steps."""
    save_reward_model(tmp_path / "rm", len(AutoTokenizer.from_pretrained(model)))
    (tmp_path / "empty.yaml").write_text("{}\n")
    return [
        "train",
        str(tmp_path / "empty.yaml"),
        f"model.path={model}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        *EAGER,
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=true",
        "data.train_batch_size=4",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=4",
        "data.max_response_length=8",
        "data.task_train_size=8",
        "data.task_val_size=4",
        "trainer.total_training_steps=2",
        "trainer.logger=[console,jsonl]",
        "reward.model.enable=true",
        f"reward.model.path={tmp_path / 'rm'}",
        *extra,
    ]


def scored_steps(run_dir: Path) -> list[dict]:
    """The training rows of a run's metrics (the validation row has no scores)."""
    return [m for m in rows_of(run_dir) if "critic/score/mean" in m]


def test_grpo_with_a_reward_model_and_every_role_offloaded(tmp_path: Path, base_model: Path) -> None:
    offload = ["reward.model.param_offload=true", "ref.fsdp.param_offload=true"]
    offload += ["actor.fsdp.param_offload=true", "actor.fsdp.optimizer_offload=true"]
    assert main(grpo_with_reward_model(base_model, tmp_path, *offload)) == 0
    train = scored_steps(tmp_path / "run")
    assert [m["step"] for m in train] == [1, 2] and finite(train)
    assert train[0]["critic/score/mean"] != 0.0  # the reward model's scores reached the advantages
    assert "perf/max_memory_reserved_gb" in train[0]  # the run computed on the GPU


def test_trainer_device_cpu_keeps_a_run_off_the_gpu(tmp_path: Path, base_model: Path) -> None:
    # A fresh process: this one's process group is NCCL once a GPU job has run in it.
    args = grpo_with_reward_model(base_model, tmp_path, "trainer.device=cpu")
    assert run_world(1, run_main, args) == [0]
    train = scored_steps(tmp_path / "run")
    assert [m["step"] for m in train] == [1, 2] and finite(train)
    assert not [k for k in train[0] if k.startswith("memory/") or k == "perf/max_memory_reserved_gb"]


def run_main(rank: int, args: list[str]) -> int:
    return main(args)


def test_generate_samples_on_the_gpu(tmp_path: Path, base_model: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "12+7="}, {"prompt": "3*4="}])
    out = tmp_path / "gen.jsonl"
    cmd = ["generate", "--model", str(base_model), "--prompts", str(prompts), "--out", str(out)]
    assert main([*cmd, "--n", "2", "--max-new-tokens", "5", "--seed", "1", "--ignore-eos"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 4
    for r in lines:
        assert len(r["token_ids"]) == len(r["logprobs"]) == 5 and all(lp <= 0 for lp in r["logprobs"])


def test_eval_validates_a_model_on_the_gpu(tmp_path: Path, base_model: Path, capsys) -> None:
    # The frozen actor's rollout reads the FSDP2 shards in place at world 1 (no cast copy): this runs that path.
    config = tmp_path / "eval.yaml"
    config.write_text(f"model:\n  path: {base_model}\ndata:\n  task_val_size: 4\n")
    out = tmp_path / "eval.jsonl"
    assert main(["eval", str(config), *EAGER, "rollout.val_kwargs.n=2", "--out", str(out)]) == 0
    assert "val-core/arithmetic/acc/mean@2" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and all(r["response"] is not None for r in rows)
