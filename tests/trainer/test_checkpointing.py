"""Checkpoints of whole runs: kill-and-resume reproduces the metrics, interrupted saves are skipped, export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridflow.checkpoint import read_meta
from hybridflow.cli.main import main
from hybridflow.config import load_config
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.trainer.checkpointing import resume_target

# PPO with a critic, an adaptive KL controller and a warm-up + cosine schedule: every piece of state counts.
RUN = [
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=8",
    "data.max_response_length=8",
    "data.task_train_size=12",  # 3 batches per epoch: a resume crosses an epoch boundary
    "data.task_val_size=4",
    "trainer.val_before_train=false",
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "actor.optim.lr=1e-3",
    "actor.optim.lr_scheduler_type=cosine",
    "actor.optim.lr_warmup_steps=2",
    "trainer.logger=[console]",
]
VOLATILE = ("timing_s/", "perf/", "async/rollout_idle_fraction")  # wall-clock figures differ between runs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=2)
    return out


REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3 == 0)  # varies within groups of a random model, so losses move
"""


def argv(model_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    config = run_dir.parent / "empty.yaml"
    config.write_text("{}\n")
    reward = run_dir.parent / "reward.py"
    reward.write_text(REWARD)
    return [
        "train",
        str(config),
        f"model.path={model_dir}",
        f"trainer.default_local_dir={run_dir}",
        f"reward.custom_function.path={reward}",
        *RUN,
        *extra,
    ]


def start_cli(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    code = "import sys; from hybridflow.cli.main import main; sys.exit(main(sys.argv[1:]))"
    # The process group this test process made (world size 1) published its port in the environment.
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK")}
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", code, *args],
            env={**inherited, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"the run exited ({proc.returncode}) before {path} appeared:\n{log.read_text()}"
            )
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path: Path, model_dir: Path) -> None:
    straight = tmp_path / "straight" / "run"
    straight.parent.mkdir()
    assert main(argv(model_dir, straight, "trainer.total_training_steps=6")) == 0

    resumed = tmp_path / "resumed" / "run"
    resumed.parent.mkdir()
    args = argv(model_dir, resumed, "trainer.total_training_steps=6", "trainer.save_freq=3")
    proc = start_cli(args, tmp_path / "first.log")
    wait_for(resumed / "global_step_3" / "meta.json", proc, tmp_path / "first.log")
    proc.send_signal(signal.SIGKILL)  # no clean-up: the process dies as on a lost node
    proc.wait()
    assert main(args) == 0  # trainer.resume defaults to auto: continues from global_step_3

    want, got = metrics(straight), metrics(resumed)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert got[step].keys() == want[step].keys()
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
    assert (
        want[4]["actor/reward_kl_penalty_coeff"] != want[1]["actor/reward_kl_penalty_coeff"]
    )  # KL state moved
    assert any(want[s]["actor/pg_loss"] != 0 for s in (4, 5, 6))
    assert read_meta(resumed / "global_step_6")["global_step"] == 6


def test_save_freq_zero_saves_no_checkpoint_but_the_final_model(tmp_path: Path, model_dir: Path) -> None:
    """``trainer.save_freq=0``: no checkpoint at all (a 7B CPU-step checkpoint is 91 GB), the HF export still."""
    run_dir = tmp_path / "job" / "run"
    run_dir.parent.mkdir()
    assert main(argv(model_dir, run_dir, "trainer.total_training_steps=2", "trainer.save_freq=0")) == 0
    assert (
        not list(run_dir.glob("*global_step_*"))
        and not (run_dir / "latest_checkpointed_iteration.txt").exists()
    )
    assert (run_dir / "final_model" / "config.json").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("timing_s/save_checkpoint" not in r for r in rows)
    assert "timing_s/update_actor" in rows[-1]  # the timings are there: only the save's is missing
    args = argv(model_dir, run_dir, "trainer.save_freq=-2")
    assert main(args) == 2  # below -1: refused, naming 0 among the fixes


def test_a_kill_during_a_save_resumes_from_the_previous_checkpoint(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "job" / "run"
    run_dir.parent.mkdir()
    args = argv(model_dir, run_dir, "trainer.total_training_steps=4", "trainer.save_freq=2")
    log = tmp_path / "killed.log"
    proc = start_cli(args, log, {"HYBRIDFLOW_TEST_SAVE_DELAY": "4:120"})  # the save of step 4 stalls midway
    wait_for(run_dir / ".global_step_4.tmp" / "trainer_state.pt", proc, log)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "global_step_4").exists()
    assert (run_dir / "global_step_2" / "meta.json").is_file()

    with caplog.at_level("INFO"):
        assert main(args) == 0
    assert "interrupted" in caplog.text and "global_step_2" in caplog.text
    assert "resumed from" in caplog.text
    assert sorted(metrics(run_dir)) == [1, 2, 3, 4]
    assert (run_dir / "global_step_4" / "meta.json").is_file()
    assert not (run_dir / ".global_step_4.tmp").exists()


def test_resume_settings_pick_the_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for step in (2, 5):
        (run_dir / f"global_step_{step}").mkdir(parents=True)
        (run_dir / f"global_step_{step}" / "meta.json").write_text("{}")
        (run_dir / f"global_step_{step}" / "trainer_state.pt").write_bytes(b"")  # present: not damaged
    base = [f"trainer.default_local_dir={run_dir}"]
    assert resume_target(load_config(None, base)) == run_dir / "global_step_5"  # auto: the newest
    assert resume_target(load_config(None, [*base, "trainer.resume=disable"])) is None
    assert resume_target(load_config(None, [*base, "trainer.resume_mode=disable"])) is None
    pick = run_dir / "global_step_2"
    assert resume_target(load_config(None, [*base, f"trainer.resume={pick}"])) == pick
    verl = [*base, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={pick}"]
    assert resume_target(load_config(None, verl)) == pick
    with pytest.raises(ValueError, match="neither a complete global_step_N checkpoint"):
        resume_target(load_config(None, [*base, f"trainer.resume={tmp_path / 'nothing'}"]))


def test_export_loads_in_transformers_and_generates_like_the_trainer(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    from hybridflow.trainer.builder import build_components
    from hybridflow.trainer.ppo import PPOTrainer

    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            *RUN,
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={run_dir}",
            "trainer.save_hf=true",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        ],
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = PPOTrainer(cfg, build_components(cfg, model, tokenizer))
    trainer.fit()  # saves global_step_2 at the end
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    assert "exported the actor" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()

    c = trainer.c
    prompts = [c.val[i]["input_ids"] for i in range(4)]
    greedy = c.actor.sampling_params(1, 0.0, 1.0, -1, False, c.eos_token_ids, seed=None)
    rollout = c.actor.group.worker.roles["actor"].hybrid.rollout
    ours = [out[0].token_ids for out in rollout.generate([list(p) for p in prompts], greedy)]
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.get_vocab() == tokenizer.get_vocab()
    for prompt, want in zip(prompts, ours):
        got = exported.generate(
            torch.tensor([prompt]),
            max_new_tokens=cfg.data.max_response_length,
            do_sample=False,
            eos_token_id=c.eos_token_ids,
        )[0, len(prompt) :].tolist()
        assert got[: len(want)] == want
    # trainer.save_hf=true: the checkpoint carries an HF copy too; the critic exports as a value model.
    copy = AutoModelForCausalLM.from_pretrained(run_dir / "global_step_2" / "actor" / "huggingface")
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(copy.state_dict()[name], tensor, msg=name)
    assert (
        main(
            ["export", str(run_dir / "global_step_2"), "--out", str(tmp_path / "critic"), "--role", "critic"]
        )
        == 0
    )
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert critic.config.num_labels == 1
    # rollout dumps: one JSON line per sample of each step
    lines = (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()
    assert len(lines) == 8 and {"prompt", "response", "score", "step", "uid"} <= json.loads(lines[0]).keys()
    # export refuses to overwrite, and names a missing checkpoint
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2


def test_eval_validates_a_checkpoint_and_writes_generations(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = tmp_path / "job" / "run"
    run_dir.parent.mkdir()
    assert main(argv(model_dir, run_dir, "trainer.total_training_steps=1")) == 0
    out = tmp_path / "eval.jsonl"
    code = main(
        [
            "eval",
            str(run_dir),
            "rollout.val_kwargs.n=2",
            "rollout.val_kwargs.do_sample=true",
            "rollout.val_kwargs.temperature=1.0",
            "--out",
            str(out),
        ]
    )
    text, err = capsys.readouterr()
    assert code == 0, err
    assert "val-core/arithmetic/acc/mean@2" in text and "pass@2" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8  # 4 held-out prompts x 2 samples
    assert {"prompt", "response", "ground_truth", "score", "acc"} <= rows[0].keys()
    assert main(["eval", str(tmp_path / "missing")]) == 2


def test_resuming_with_another_model_is_refused_at_the_command_line(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = tmp_path / "job" / "run"
    run_dir.parent.mkdir()
    assert main(argv(model_dir, run_dir, "trainer.total_training_steps=1")) == 0
    wider = tmp_path / "wider"
    build_tiny_model_and_tokenizer(out_dir=wider, hidden_size=48, num_hidden_layers=2)
    capsys.readouterr()
    assert main(argv(wider, run_dir, "trainer.total_training_steps=2")) == 2
    err = capsys.readouterr().err
    assert f"its actor started from {model_dir.resolve()}, this run's model.path is {wider.resolve()}" in err
    assert "config.json differs (hidden_size: 32 vs 48, " in err and "Traceback" not in err
    # a checkpoint saved before the record existed: the parameters' shapes are checked
    meta_path = run_dir / "global_step_1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["models"]
    meta_path.write_text(json.dumps(meta))
    assert main(argv(wider, run_dir, "trainer.total_training_steps=2")) == 2
    err = capsys.readouterr().err
    assert "the actor in" in err and "does not match this model" in err
    assert "lm.model.embed_tokens.weight: checkpoint" in err and ", 32) vs model (" in err
    assert "Traceback" not in err
    assert (run_dir / "global_step_1" / "meta.json").is_file()  # the user's checkpoint is untouched


def test_eval_of_a_config_uses_its_model_path(tmp_path: Path, model_dir: Path, capsys) -> None:
    config = tmp_path / "eval.yaml"
    config.write_text(f"model:\n  path: {model_dir}\ndata:\n  task_val_size: 3\n")
    assert main(["eval", str(config), "--out", str(tmp_path / "gen.jsonl")]) == 0
    assert "val-core/arithmetic/acc/mean@1" in capsys.readouterr().out
    assert len((tmp_path / "gen.jsonl").read_text().splitlines()) == 3


def test_the_trainer_state_carries_the_cpu_thread_count_to_the_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from hybridflow.trainer.checkpointing import restore_trainer_state, trainer_state
    from hybridflow.utils import threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    saver = SimpleNamespace(global_step=4, sampler=None, kl_ctrl=None)
    monkeypatch.setattr(threads, "_decided", (0, threads.ThreadPlan(2, "auto, when the run started")))
    state = trainer_state(saver)
    assert state["cpu_threads"] == 2
    monkeypatch.setattr(threads, "_decided", (0, threads.ThreadPlan(1, "auto, busier now")))
    resumed = SimpleNamespace(global_step=0, sampler=None, kl_ctrl=None, cfg=load_config(None, []))
    try:
        restore_trainer_state(resumed, state)
        assert resumed.global_step == 4 and torch.get_num_threads() == 2  # computes as the saved run did
    finally:
        torch.set_num_threads(before)
