"""``hybridflow train`` plans the layout as the notebook API does (``plan.auto_layout``): the keys the user did
not set take the planned values, one log line names them, a key the user set wins (even when the plan says it
does not fit), ``trainer.auto_layout=false`` plans nothing, and a CPU run is the same as without the plan."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import hybridflow
from hybridflow.cli.main import main
from hybridflow.cli.train_cmd import planned_config
from hybridflow.config import load_config
from hybridflow.config.user_keys import user_keys
from hybridflow.config.validate import get_path
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.plan.search import LAYOUT_KEYS
from hybridflow.plan.shapes import MODEL_SHAPES
from hybridflow.trainer import jobs

GB80 = 80 * 10**9
# The 7B shape on 4 GPUs of 80 GB, 256 prompts x 8 samples: whole rollout replicas leave too little room for
# the KV cache, so the plan picks rollout tensor-parallel groups (test_layout's case)
WIDE = [
    "trainer.n_gpus_per_node=4",
    "data.train_batch_size=256",
    "rollout.n=8",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "model.enable_gradient_checkpointing=true",
]
ROLLOUT_TP = "rollout.tensor_model_parallel_size"


pytestmark = pytest.mark.usefixtures("restore_cli_logging")


@pytest.fixture(scope="module")
def shape_7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding only the 7B shape's config.json (the plan reads no weights)."""
    out = tmp_path_factory.mktemp("qwen2_7b")
    shape = dict(MODEL_SHAPES["qwen2.5-7b"], architectures=["Qwen2ForCausalLM"])
    (out / "config.json").write_text(json.dumps(shape))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "m"
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=1)
    return out


def _planned_line(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    (record,) = [r for r in caplog.records if r.getMessage().startswith("auto layout")]
    return record


def test_the_unset_keys_take_the_planned_values_and_one_line_names_them(
    shape_7b: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hybridflow")
    cfg = planned_config(None, [f"model.path={shape_7b}", *WIDE], GB80)
    tp = cfg.rollout.tensor_model_parallel_size
    assert (
        tp > 1
        and load_config(None, [f"model.path={shape_7b}", *WIDE]).rollout.tensor_model_parallel_size == 1
    )
    record = _planned_line(caplog)
    planned = record.getMessage().split("; planned keys: ")[1].split()
    assert record.levelno == logging.INFO and f"{ROLLOUT_TP}={tp}" in planned
    # every key but model.enable_gradient_checkpointing (set), rollout.max_num_seqs (one wave fits),
    # rollout.expert_parallel_size and actor.parallel.ep (a dense model has no experts)
    assert len(planned) == len(LAYOUT_KEYS) - 4
    assert any(key.startswith("actor.fsdp.optimizer_offload=") for key in planned)


@pytest.mark.parametrize(
    ("spelling", "in_file"),
    [
        (f"{ROLLOUT_TP}=1", False),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size=1", False),  # verl's key
        ("rollout={tensor_model_parallel_size: 1}", False),  # a mapping counts key by key
        (f"{ROLLOUT_TP}=1", True),  # in the YAML file
    ],
)
def test_a_key_the_user_set_wins_even_at_its_default_value(
    spelling: str, in_file: bool, shape_7b: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hybridflow")
    overrides = [f"model.path={shape_7b}", *WIDE]
    path = None
    if in_file:
        path = tmp_path / "run.yaml"
        path.write_text("rollout:\n  tensor_model_parallel_size: 1\n")
        path = str(path)
    else:
        overrides.append(spelling)
    cfg = planned_config(path, overrides, GB80)
    assert cfg.rollout.tensor_model_parallel_size == 1  # 1 is the default: what counts is that it was set
    message = _planned_line(caplog).getMessage()
    assert f"kept from the config: {ROLLOUT_TP}=1" in message
    assert ROLLOUT_TP not in message.split("; planned keys: ")[1]


def test_a_user_set_layout_that_does_not_fit_runs_as_set_with_a_warning(
    shape_7b: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hybridflow")
    overrides = [f"model.path={shape_7b}", *WIDE, "actor.tensor_parallel_size=1", f"{ROLLOUT_TP}=1"]
    cfg = planned_config(None, overrides, 24 * 10**9)
    assert (cfg.actor.tensor_parallel_size, cfg.rollout.tensor_model_parallel_size) == (1, 1)
    record = _planned_line(caplog)
    message = record.getMessage()
    assert (
        record.levelno == logging.WARNING and "no layout fits" in message and " GB" in message
    )  # the estimate
    kept = (
        f"actor.tensor_parallel_size, {ROLLOUT_TP}, model.enable_gradient_checkpointing"  # WIDE sets the last
    )
    assert f"runs as configured ({kept} as set)" in message


def test_auto_layout_false_leaves_the_layout_keys_as_configured(
    shape_7b: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hybridflow")
    overrides = [f"model.path={shape_7b}", *WIDE, "trainer.auto_layout=false"]
    assert planned_config(None, overrides, GB80).to_dict() == load_config(None, overrides).to_dict()
    assert not [r for r in caplog.records if r.getMessage().startswith("auto layout")]
    assert "trainer.auto_layout=false: the layout as configured" in caplog.text


def test_auto_layout_takes_only_a_boolean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "trainer.auto_layout=sometimes"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert "trainer.auto_layout" in line


@pytest.mark.parametrize("ranks", [1, 2])
def test_hybridflow_train_on_cpu_plans_and_runs_the_config_it_ran_before(
    ranks: int, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CLI logs the plan; on CPU it is the plain layout, so the run's config is the one without a plan."""
    ran = []
    monkeypatch.setattr(jobs, "rl_job", lambda cfg: ran.append(cfg) or [])  # the config the run gets
    caplog.set_level(logging.INFO, "hybridflow")
    overrides = [f"model.path={tiny}", "trainer.device=cpu", f"trainer.n_gpus_per_node={ranks}"]
    overrides += [f"trainer.default_local_dir={tmp_path}", "data.train_batch_size=4", "rollout.n=2"]
    overrides += ["actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=1"]
    assert main(["train", *overrides[:2], "--log-level", "info", *overrides[2:]]) == 0
    assert main(["train", *overrides, "trainer.auto_layout=false"]) == 0
    planned, unplanned = ran
    kept = "kept from the config: actor.ppo_micro_batch_size_per_gpu=1"  # a layout key since issue 40
    assert f"without a GPU: nothing to fit, the plain layout; {kept}; planned keys: " in caplog.text
    unplanned.trainer.auto_layout = True
    assert planned.to_dict() == unplanned.to_dict() == load_config(None, overrides).to_dict()


def test_the_notebook_api_plans_through_the_same_function_and_key(tiny: Path) -> None:
    common = dict(model_name=str(tiny), max_steps=1, per_device_train_batch_size=2)
    planned = hybridflow.RLTrainer(**common)
    # per_device_train_batch_size sets the micro-batch (a layout key): kept, every other layout key planned
    assert planned.layout is not None and planned.layout.kept == {"actor.ppo_micro_batch_size_per_gpu": 2}
    off = hybridflow.RLTrainer(**common, overrides=["trainer.auto_layout=false"])
    assert off.layout is None and off.cfg.trainer.auto_layout is False
    off.cfg.trainer.auto_layout = True
    assert off.cfg.to_dict() == planned.cfg.to_dict()  # on CPU the plan is the defaults
    kept = hybridflow.RLTrainer(**common, overrides=["actor.fsdp.optimizer_offload=false"])
    assert kept.layout is not None and kept.layout.kept == {
        "actor.fsdp.optimizer_offload": False,
        "actor.ppo_micro_batch_size_per_gpu": 2,
    }


def test_user_keys_are_the_files_and_the_overrides_paths() -> None:
    file = {"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 2}}, "trainer": {"seed": 1}}
    overrides = ["actor.fsdp={param_offload: true}", "++rollout.n=4"]
    assert user_keys(file, overrides) == {
        ROLLOUT_TP,
        "trainer.seed",
        "actor.fsdp.param_offload",
        "rollout.n",
    }


def test_gpu_memory_gb_plans_for_that_share_of_the_gpu(
    shape_7b: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``trainer.gpu_memory_gb=80`` on a 141 GB GPU plans as for an 80 GB one (the run caps itself there)."""
    caplog.set_level(logging.INFO, "hybridflow")
    overrides = [f"model.path={shape_7b}", *WIDE]
    whole = planned_config(None, overrides, 141 * 10**9)
    assert "of 141 GB" in _planned_line(caplog).getMessage()
    caplog.clear()
    capped = planned_config(None, [*overrides, "trainer.gpu_memory_gb=80"], 141 * 10**9)
    assert "of 80 GB" in _planned_line(caplog).getMessage()
    caplog.clear()
    at_80 = planned_config(None, overrides, GB80)
    keys = lambda cfg: {path: get_path(cfg, path) for path in LAYOUT_KEYS}  # noqa: E731
    assert keys(capped) == keys(at_80) != keys(whole)  # 80 GB offloads the moments, 141 does not
    assert capped.actor.fsdp.optimizer_offload and not whole.actor.fsdp.optimizer_offload


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_plan_command_plans_for_the_runs_gpu_memory_gb(
    shape_7b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No GPU here: the run's cap stands for the size of the GPU it will run on."""
    assert main(["plan", f"model.path={shape_7b}", *WIDE, "trainer.gpu_memory_gb=24"]) == 0
    assert "GPU(s) of 24 GB" in capsys.readouterr().out


@pytest.mark.parametrize("gpu_bytes", [GB80, None])  # planned for an 80 GB GPU, and on a CPU (no GPU)
def test_a_vision_language_model_is_planned_by_the_run(gpu_bytes: int | None, tmp_path: Path) -> None:
    """The train command's planning of a tiny Qwen2.5-VL: FSDP2 alone, whole rollout replicas."""
    from hybridflow.models.vision import build_tiny_vl_model_and_processor

    build_tiny_vl_model_and_processor(out_dir=tmp_path / "vl")
    overrides = [f"model.path={tmp_path / 'vl'}", "trainer.n_gpus_per_node=2", "data.train_batch_size=8"]
    cfg = planned_config(None, [*overrides, "rollout.n=2", "actor.ppo_mini_batch_size=8"], gpu_bytes)
    assert cfg.actor.tensor_parallel_size == 1 and cfg.rollout.tensor_model_parallel_size == 1


# rollout.n=5 on 8 GPUs: 16 prompts x 5 = 80 samples a mini-batch, 10 per GPU, which the default micro-batch (8)
# does not divide
FIVE = ["rollout.n=5", "trainer.n_gpus_per_node=8"]


@pytest.mark.parametrize("gpu_bytes", [GB80, None])
def test_the_run_plans_a_micro_batch_its_default_would_not_divide(
    shape_7b: Path, gpu_bytes: int | None
) -> None:
    cfg = planned_config(None, [f"model.path={shape_7b}", *FIVE], gpu_bytes)
    assert 10 % cfg.actor.ppo_micro_batch_size_per_gpu == 0


def test_without_a_plan_the_default_micro_batch_is_checked_as_it_is(shape_7b: Path) -> None:
    from hybridflow.config import ConfigError

    with pytest.raises(ConfigError, match=r"actor\.ppo_micro_batch_size_per_gpu: 8 does not divide"):
        planned_config(None, [f"model.path={shape_7b}", *FIVE, "trainer.auto_layout=false"], GB80)
    with pytest.raises(ConfigError, match=r"actor\.ppo_micro_batch_size_per_gpu: 8 does not divide"):
        planned_config(None, [f"model.path={shape_7b}", *FIVE, "actor.ppo_micro_batch_size_per_gpu=8"], GB80)
