"""A CUDA out-of-memory error in any phase of a step stops the command with one ``error:`` line (exit 2).

The OOM is simulated: the role's method for the phase raises a real ``torch.OutOfMemoryError`` with CUDA's
own message, in the process that runs the phase (the in-process CLI, or each of two torchrun-style ranks).
What is under test is everything after it: the rank's phase call, the driver, the planner's estimate and
the command line. The line names the phase and role, the bytes asked for, the plan's estimate (or that it
has none) and the keys that shrink the phase.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reliability_util import train_argv

from hybridflow.cli.main import main
from hybridflow.config import Config, load_config
from hybridflow.config.validate import get_path
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.models.loader import load_config as load_model_config
from hybridflow.plan.memory import estimate_phases
from hybridflow.plan.search import meta_model
from hybridflow.trainer.oom import gigabytes, run_layout
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.oom import PHASES, DeviceOutOfMemory, fix_keys, phase_of, requested_bytes
from hybridflow.workers.reference import ReferenceWorker

REPO = Path(__file__).resolve().parents[2]
MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
    "1.06 GiB is free. Including non-PyTorch memory, this process has 78.08 GiB memory in use."
)
# Every phase of an RL step: GAE brings the critic (values, its update), the KL loss the reference, and two
# mini-batches a separate old-log-prob pass.
RL_STEP = (
    "trainer.total_training_steps=1",
    "algorithm.adv_estimator=gae",
    "actor.use_kl_loss=true",
    "actor.ppo_mini_batch_size=2",
    "actor.ppo_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
)
# phase -> (the class and method that raise, the role.method the line names, a key it names).
RL_PHASES = {
    "generate": (ActorWorker, "generate", "actor.generate", "rollout.gpu_memory_utilization"),
    "old_log_prob": (
        ActorWorker, "compute_log_prob", "actor.compute_log_prob", "rollout.log_prob_micro_batch_size_per_gpu"
    ),
    "ref": (
        ReferenceWorker, "compute_ref_log_prob", "ref.compute_ref_log_prob", "ref.log_prob_micro_batch_size_per_gpu"
    ),
    "values": (CriticWorker, "compute_values", "critic.compute_values", "critic.ppo_micro_batch_size_per_gpu"),
    "update_critic": (
        CriticWorker, "update_critic", "critic.update_critic", "critic.model.enable_gradient_checkpointing"
    ),
    "update_actor": (ActorWorker, "update_actor", "actor.update_actor", "model.enable_gradient_checkpointing"),
    "driver": (PPOTrainer, "_advantages", "driver.step", "data.train_batch_size"),  # between the phases
}  # fmt: skip
ESTIMATED = {
    "generate": "generate",
    "old_log_prob": "log_prob",
    "ref": "log_prob",
    "update_actor": "update_actor",
}


def raise_oom(*args: object, **kwargs: object) -> None:
    raise torch.OutOfMemoryError(MESSAGE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=1)
    return out


def one_line(code: int, err: str) -> str:
    """The one ``error:`` line of a run that exited 2 without a traceback."""
    assert code == 2, err[-3000:]
    assert "Traceback" not in err and "internal error" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    return errors[0]


def planned(argv: list[str], phase: str) -> str:
    """The planner's estimate of ``phase`` for the run's own config, as the line prints it."""
    cfg = load_config(None, [a for a in argv if "=" in a])
    model_config = load_model_config(cfg.model.path)
    needed = estimate_phases(cfg, model_config, meta_model(model_config), run_layout(cfg))[phase]
    return f"the plan estimates {gigabytes(needed)} per GPU for it ({phase}"


def test_the_bytes_asked_for_are_read_from_the_message() -> None:
    assert requested_bytes(MESSAGE) == 2 * 2**30
    assert requested_bytes("Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity)") == 20 * 2**20
    assert requested_bytes("Tried to allocate 512 bytes") == 512
    assert requested_bytes("out of memory") is None
    error = DeviceOutOfMemory("actor", "update_actor", None, None)
    line = str(error)
    assert "asked for an unknown size" in line and "actor.ppo_micro_batch_size_per_gpu" in line
    error.estimate = "the plan estimates 1.00 GB per GPU for it"
    again = pickle.loads(pickle.dumps(error))  # how a Ray rank's error reaches the driver
    assert isinstance(again, DeviceOutOfMemory) and str(again) == str(error), str(again)


def test_every_key_a_fix_names_is_a_config_key() -> None:
    for phase in PHASES.values():
        keys = re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)", phase.fix)
        assert keys, phase
        for key in keys:
            get_path(Config(), key)  # raises AttributeError for a key the schema does not have


@pytest.mark.parametrize("phase", RL_PHASES)
def test_an_oom_in_each_phase_of_an_rl_step_is_one_line(
    phase: str,
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cls, method, named, key = RL_PHASES[phase]
    monkeypatch.setattr(cls, method, raise_oom)
    argv = train_argv(model_dir, tmp_path / "run", *RL_STEP)
    line = one_line(main(argv), capsys.readouterr().err)
    assert "out of device memory" in line and f"({named})" in line, line
    assert "asked for 2.0 GiB" in line and key in line, line
    first = fix_keys(phase_of(*named.split(".")))[0]  # its value in this run comes with it
    value = get_path(load_config(None, [a for a in argv if "=" in a]), first)
    assert f"{first} (now {value})" in line, line
    if phase in ESTIMATED:
        assert planned(argv, ESTIMATED[phase]) in line, line
    else:
        assert "the layout planner has no estimate for this phase" in line, line


@pytest.mark.gpu
def test_a_real_cuda_oom_in_the_update_is_one_line_with_the_free_memory(
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def too_big(*args: object, **kwargs: object) -> None:  # 4 PiB: CUDA's own error, with its message
        torch.empty(2**50, dtype=torch.float32, device="cuda")

    monkeypatch.setattr(ActorWorker, "update_actor", too_big)
    argv = train_argv(model_dir, tmp_path / "run", "trainer.total_training_steps=1", "trainer.device=cuda")
    line = one_line(main(argv), capsys.readouterr().err)
    assert "(actor.update_actor)" in line and "asked for 4096.0 TiB" in line and " free of " in line, line
    assert planned(argv, "update_actor") in line, line


def preference_argv(command: str, model_dir: Path, tmp_path: Path) -> list[str]:
    def prompt(i: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"What is {i} plus {i + 3}?" + " Show the sum." * (i % 2)}]

    if command == "kto":  # unpaired: a completion and whether it is desirable
        rows = [{"prompt": prompt(i), "completion": f"It is {2 * i + 3 + i % 2}.", "label": i % 2 == 0}
                for i in range(4)]  # fmt: skip
    else:
        rows = [{"prompt": prompt(i), "chosen": f"{2 * i + 3}", "rejected": f"It is {2 * i + 5}, I think."}
                for i in range(4)]  # fmt: skip
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "trainer.total_training_steps=1"]
    return [command, f"model.path={model_dir}", f"data.train_files=[{data}]", *common,
            f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[console]"]  # fmt: skip


def sft_argv(model_dir: Path, tmp_path: Path) -> list[str]:
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}+1="}], "response": f"#### {i + 1}" + " ok" * i}
        for i in range(4)
    ]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["sft", f"model.path={model_dir}", f"data.train_files=[{data}]", "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2", "trainer.total_training_steps=1",
            f"trainer.default_local_dir={tmp_path / 'run'}", "--out", str(tmp_path / "out")]  # fmt: skip


@pytest.mark.parametrize(
    "command,method", [("sft", "update_sft"), ("dpo", "update_preference"), ("kto", "update_preference")]
)
def test_an_oom_in_the_sft_dpo_and_kto_updates_is_one_line(
    command: str,
    method: str,
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(ActorWorker, method, raise_oom)
    argv = (
        sft_argv(model_dir, tmp_path) if command == "sft" else preference_argv(command, model_dir, tmp_path)
    )
    line = one_line(main(argv), capsys.readouterr().err)
    assert f"(actor.{method})" in line and "asked for 2.0 GiB" in line, line
    assert "the layout planner has no estimate for this phase" in line, line
    assert "model.enable_gradient_checkpointing" in line and "actor.fsdp.optimizer_offload" in line, line


# One rank of two runs out of memory in the actor's update; each writes its exit status and stderr (and
# exits 0, so that torchrun lets the other rank finish its report).
RUNNER = """
import contextlib, io, json, os, sys
import torch
from hybridflow.cli.main import main
from hybridflow.workers.actor import ActorWorker

def raise_oom(*args, **kwargs):
    raise torch.OutOfMemoryError(sys.argv[3])

if os.environ["RANK"] == sys.argv[2]:
    ActorWorker.update_actor = raise_oom
err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = main(json.loads(sys.argv[1]))
sys.stderr.write(err.getvalue())
with open(os.environ["RESULTS"] + f".rank{os.environ['RANK']}.json", "w") as out:
    json.dump([code, err.getvalue()], out)
"""


@pytest.mark.parametrize("failing", [1, pytest.param(0, marks=pytest.mark.slow)])  # 0: rank 0 fails
def test_an_oom_on_one_of_two_torchrun_ranks_is_the_same_line_on_both(
    failing: int, model_dir: Path, tmp_path: Path
) -> None:
    argv = train_argv(
        model_dir, tmp_path / "run", "trainer.total_training_steps=1", "trainer.n_gpus_per_node=2",
        "actor.ppo_micro_batch_size_per_gpu=4", "trainer.nccl_timeout=120",
    )  # fmt: skip
    drop = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        RESULTS=str(tmp_path / "results"),
    )
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*launch, str(script), json.dumps(argv), str(failing), MESSAGE],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [one_line(*json.loads((tmp_path / f"results.rank{r}.json").read_text())) for r in range(2)]
    assert lines[0] == lines[1], lines
    assert f"(actor.update_actor on rank {failing} of 2)" in lines[0] and "asked for 2.0 GiB" in lines[0]
    assert "peer" not in lines[0], lines[0]


# A sitecustomize module for the Ray driver and its rank actors: with HYBRIDFLOW_TEST_OOM=RANK, that rank's
# actor update raises CUDA's out-of-memory error (patched once hybridflow.workers.actor is imported).
OOM_SITE = """
import importlib.abc, importlib.util, os, sys

MESSAGE = os.environ.get("HYBRIDFLOW_TEST_OOM_MESSAGE", "")


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "hybridflow.workers.actor" or not os.environ.get("HYBRIDFLOW_TEST_OOM"):
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = module.ActorWorker.update_actor

            def update_actor(self, batch):
                import torch
                import torch.distributed as dist

                rank = dist.get_rank() if dist.is_initialized() else 0
                if str(rank) == os.environ["HYBRIDFLOW_TEST_OOM"]:
                    raise torch.OutOfMemoryError(MESSAGE)
                return real(self, batch)

            module.ActorWorker.update_actor = update_actor

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
"""


@pytest.mark.ray
@pytest.mark.slow
def test_an_oom_on_one_ray_rank_is_one_line(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(OOM_SITE)
    drop = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        HYBRIDFLOW_TEST_OOM="1",
        HYBRIDFLOW_TEST_OOM_MESSAGE=MESSAGE,
    )
    argv = train_argv(
        model_dir, tmp_path / "run", "trainer.total_training_steps=1", "trainer.n_gpus_per_node=2",
        "actor.ppo_micro_batch_size_per_gpu=4", "trainer.backend=ray", "trainer.nccl_timeout=120",
    )  # fmt: skip
    code = "import sys; from hybridflow.cli.main import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=600
    )
    line = one_line(done.returncode, done.stderr)
    assert "(actor.update_actor on rank 1 of 2)" in line and "asked for 2.0 GiB" in line, line
    assert planned(argv, "update_actor") in line, line
