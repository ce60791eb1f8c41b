"""The model a run started from: its config and weights digest, and the refusal of another model's checkpoint."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from hybridflow.checkpoint import CheckpointError, identity
from hybridflow.checkpoint.identity import check_identity, model_identity
from hybridflow.models import build_tiny_model_and_tokenizer


def _tiny(folder: Path, seed: int = 0, **kwargs: object) -> Path:
    model, _ = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=2, seed=seed)
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "a": _tiny(root / "a"),
        "b": _tiny(root / "b", seed=1),  # same shapes, other weights
        "a_shards": _tiny(root / "a_shards", max_shard_size="20KB"),  # a's weights in several files
    }


@pytest.mark.parametrize("whole", [True, False], ids=["hashed-whole", "sampled"])
def test_the_weights_digest_tells_seeds_apart_and_ignores_the_shard_files(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, whole: bool
) -> None:
    if not whole:
        monkeypatch.setattr(identity, "FULL_DIGEST_BYTES", 0)  # as a model of many GB is read
    assert len(list(models["a_shards"].glob("*.safetensors"))) > 1
    a, b = identity.weights_digest(models["a"]), identity.weights_digest(models["b"])
    assert a is not None and a != b
    assert identity.weights_digest(models["a_shards"]) == a


def test_a_changed_tensor_changes_the_digest(models: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(models["a"], tmp_path / "a"))
    weights = load_file(copy / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name].view(-1)[0] += 1e-3  # one element of one tensor
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    assert identity.weights_digest(copy) != identity.weights_digest(models["a"])


def test_the_config_is_compared_without_bookkeeping_keys_and_with_overrides(
    models: dict[str, Path], tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(models["a"], tmp_path / "a"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(
        json.dumps({**config, "transformers_version": "0.0.1", "use_cache": False})
    )
    base = model_identity(models["a"])
    assert model_identity(copy)["config"] == base["config"]  # a re-save by another transformers
    theta = model_identity(models["a"], {"rope_theta": 1234.0})
    assert theta["config"]["rope_theta"] == 1234.0 and theta["weights"] == base["weights"]
    assert model_identity(tmp_path / "nowhere") is None and model_identity(None) is None


def test_another_model_is_refused_naming_both(models: dict[str, Path], tmp_path: Path) -> None:
    ckpt = tmp_path / "global_step_3"
    saved = {"actor": model_identity(models["a"])}
    check_identity(ckpt, saved, {"actor": model_identity(models["a_shards"])})  # same model: resumes
    with pytest.raises(CheckpointError) as err:
        check_identity(ckpt, saved, {"actor": model_identity(models["b"])})
    message = str(err.value)
    assert (
        f"its actor started from {models['a'].resolve()}, this run's model.path is {models['b'].resolve()}"
        in (message)
    )
    assert "the weights differ" in message and "config.json" not in message
    assert "trainer.default_local_dir" in message and "trainer.resume=disable" in message
    other_theta = Path(shutil.copytree(models["a"], tmp_path / "theta"))
    config = json.loads((other_theta / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500000.0  # same weights, another config
    (other_theta / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"config.json differs \(rope_parameters: \{.*'rope_theta': 500000.0"
    ):
        check_identity(ckpt, saved, {"actor": model_identity(other_theta)})
    with pytest.raises(CheckpointError, match=r"config.json differs \(rope_theta: None vs 500000.0\)"):
        check_identity(ckpt, saved, {"actor": model_identity(models["a"], {"rope_theta": 500000.0})})
    with pytest.raises(CheckpointError, match=r"its critic started from .* critic.model.path is"):
        check_identity(ckpt, {"critic": saved["actor"]}, {"critic": model_identity(models["b"])})


def test_a_checkpoint_without_a_record_resumes_with_a_notice(
    models: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="hybridflow.checkpoint.identity"):
        check_identity(tmp_path / "global_step_1", None, {"actor": model_identity(models["b"])})
    assert len(caplog.records) == 1 and "does not record which model it was trained from" in caplog.text


LORA = {
    "rank": 8,
    "alpha": 16.0,
    "dropout": 0.0,
    "target_modules": ["self_attn.q_proj", "self_attn.v_proj"],
}


@pytest.mark.parametrize(
    ("field", "value", "key", "shown"),
    [
        ("alpha", 128.0, "model.lora_alpha", "model.lora_alpha was 16.0 there and is 128.0 here"),
        ("rank", 4, "model.lora_rank", "model.lora_rank was 8 there and is 4 here"),
        ("dropout", 0.1, "model.lora_dropout", "model.lora_dropout was 0.0 there and is 0.1 here"),
        (
            "target_modules",
            ["self_attn.q_proj"],
            "model.target_modules",
            "model.target_modules was ['self_attn.q_proj', 'self_attn.v_proj'] there and is "
            "['self_attn.q_proj'] here",
        ),
    ],
)
def test_other_lora_settings_are_refused_naming_the_key_both_values_and_the_fix(
    tmp_path: Path, field: str, value: object, key: str, shown: str
) -> None:
    ckpt = tmp_path / "global_step_2"
    identity.check_adapters(ckpt, "actor", LORA, dict(LORA))  # the same settings resume
    with pytest.raises(CheckpointError) as err:
        identity.check_adapters(ckpt, "actor", LORA, {**LORA, field: value})
    message = str(err.value)
    assert message.startswith(
        f"{ckpt} was trained with other LoRA settings than this run's (actor): {shown}. "
    )
    back = {
        "alpha": "16.0",
        "rank": "8",
        "dropout": "0.0",
        "target_modules": "[self_attn.q_proj,self_attn.v_proj]",
    }[field]
    assert (
        f"Resume it with {key}={back}, or train with the new settings in a new trainer.default_local_dir"
        in (message)
    )
    assert "trainer.resume=disable" in message


def test_adapters_against_a_run_without_them_and_the_reverse_are_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "global_step_2"
    identity.check_adapters(ckpt, "actor", None, None)  # neither has adapters
    with pytest.raises(CheckpointError) as err:
        identity.check_adapters(ckpt, "actor", LORA, None)
    assert "model.lora_rank was 8 there and is 0 here" in str(err.value)
    # every setting to put back, not the rank alone (the defaults would trip the next attempt)
    assert (
        "Resume it with model.lora_rank=8 model.lora_alpha=16.0 model.lora_dropout=0.0 "
        "model.target_modules=[self_attn.q_proj,self_attn.v_proj]," in str(err.value)
    )
    with pytest.raises(CheckpointError, match=r"model.lora_rank was 0 there and is 8 here\. .*lora_rank=0,"):
        identity.check_adapters(ckpt, "actor", None, LORA)
