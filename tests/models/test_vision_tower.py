"""Loading a saved vision-language model directory (the VLM class and its processor), freezing its tower, and
the refusals of what VLM training does not implement (each naming its setting)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.config.schema import Config
from hybridflow.models import build_tiny_model_and_tokenizer, load_causal_lm, load_tokenizer
from hybridflow.models.vision import build_tiny_vl_model_and_processor
from hybridflow.models.vision_tower import (
    check_vision_training,
    is_vision_param,
    load_vision_processor,
    set_vision_trainable,
    vision_spec,
    vision_units,
)
from hybridflow.utils.errors import UserError


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_vl")
    build_tiny_vl_model_and_processor(out, seed=1)
    return out


def test_a_saved_vlm_dir_loads_as_its_vision_language_class_with_its_processor(vl_dir: Path) -> None:
    model = load_causal_lm(vl_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    want, processor = build_tiny_vl_model_and_processor(seed=1)
    for name, tensor in want.state_dict().items():  # the vision tower too
        assert (model.state_dict()[name] == tensor).all(), name
    loaded = load_vision_processor(vl_dir, load_tokenizer(vl_dir), model.config)
    assert (loaded.image_token_id, loaded.merge_size) == (processor.image_token_id, processor.merge_size)
    spec = vision_spec(model.config)
    assert (spec.image_token_id, spec.merge_size, spec.patch_dim) == (
        processor.image_token_id,
        2,
        3 * 2 * 14 * 14,
    )
    units = vision_units(model)
    assert units[-1] is model.model.visual and units[-2] is model.model.visual.merger and len(units) == 4


def test_a_text_model_has_no_processor_tower_or_spec() -> None:
    model, tokenizer = build_tiny_model_and_tokenizer()
    assert load_vision_processor("/nowhere", tokenizer, model.config) is None
    assert vision_spec(model.config) is None and vision_units(model) == []
    assert set_vision_trainable(model, False) == 0 and all(p.requires_grad for p in model.parameters())


def test_a_vlm_dir_without_its_image_processor_is_refused(vl_dir: Path, tmp_path: Path) -> None:
    for f in vl_dir.iterdir():
        if f.name != "preprocessor_config.json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    model = load_causal_lm(tmp_path)
    with pytest.raises(UserError, match=r"preprocessor_config\.json"):
        load_vision_processor(tmp_path, load_tokenizer(tmp_path), model.config)


def test_freezing_the_tower_covers_the_merger_and_nothing_else() -> None:
    model, _ = build_tiny_vl_model_and_processor()
    assert set_vision_trainable(model, False) > 0
    for name, param in model.named_parameters():
        assert param.requires_grad != is_vision_param(name), name
    set_vision_trainable(model, True)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("actor.parallel.tp", 2, "actor.parallel.tp=2"),
        ("actor.parallel.pp", 2, "actor.parallel.pp=2"),
        ("ref.parallel.sp", 2, "ref.parallel.sp=2"),
        ("critic.enable", True, "critic"),
        ("model.lora_rank", 8, "model.lora_rank=8"),
    ],
)
def test_vlm_training_refuses_what_it_does_not_implement(key: str, value, match: str) -> None:
    config = build_tiny_vl_model_and_processor()[0].config
    cfg = Config()
    check_vision_training(cfg, config)  # the defaults pass
    section, *rest = key.split(".")
    target = getattr(cfg, section)
    for part in rest[:-1]:
        target = getattr(target, part)
    setattr(target, rest[-1], value)
    with pytest.raises(UserError, match=match):
        check_vision_training(cfg, config)
    check_vision_training(cfg, build_tiny_model_and_tokenizer()[0].config)  # a text model: unchanged


@pytest.mark.parametrize("command", ["dpo", "kto"])
def test_the_commands_without_image_data_refuse_a_vlm(command: str) -> None:
    with pytest.raises(UserError, match=f"hybridflow {command}"):
        check_vision_training(Config(), build_tiny_vl_model_and_processor()[0].config, command)
