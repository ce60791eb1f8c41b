"""A vision-language policy through the builder: the processor reaches the components and the rank, the tower
is frozen by default (``model.freeze_vision_tower``) and trained on request, the final model is written with
its processor files, and a critic is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.vision_batches import hf_log_probs, vision_batch

from hybridflow.config.schema import Config
from hybridflow.models import build_tiny_model_and_tokenizer, load_causal_lm
from hybridflow.models.vision import VisionProcessor, build_tiny_vl_model_and_processor
from hybridflow.models.vision_tower import is_vision_param
from hybridflow.trainer.builder import build_components
from hybridflow.utils.errors import UserError


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_vl_roles")
    build_tiny_vl_model_and_processor(out, extra_chars="0123456789+-*= ?", seed=2)
    return out


def vl_config(path: Path, **model: object) -> Config:
    cfg = Config()
    cfg.model.path = str(path)
    cfg.data.train_batch_size = cfg.data.val_batch_size = 4
    cfg.data.task_train_size, cfg.data.task_val_size = 8, 4
    cfg.trainer.total_training_steps = 1
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


def tower_grads(components) -> list[bool]:
    worker = components.groups[0].worker
    return [
        p.requires_grad
        for n, p in worker.roles["actor"].engine.module.named_parameters()
        if is_vision_param(n)
    ]


@pytest.mark.parametrize("freeze", [True, False])
def test_the_builder_loads_the_processor_and_freezes_the_tower_as_configured(
    vl_dir: Path, tmp_path: Path, freeze: bool
) -> None:
    components = build_components(vl_config(vl_dir, freeze_vision_tower=freeze))
    try:
        assert isinstance(components.processor, VisionProcessor)
        worker = components.groups[0].worker
        assert worker.processor is components.processor
        grads = tower_grads(components)
        assert grads and all(g != freeze for g in grads)
        if freeze:  # the final model: the whole VLM and its processor's files
            out = Path(worker.save_hf_model(str(tmp_path / "final")))
            assert (out / "preprocessor_config.json").is_file() and (out / "tokenizer.json").is_file()
            from transformers import AutoModelForImageTextToText

            saved = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).state_dict()
            original = build_tiny_vl_model_and_processor(extra_chars="0123456789+-*= ?", seed=2)[
                0
            ].state_dict()
            for name, tensor in original.items():
                torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=name)
    finally:
        components.close()


def test_the_handles_send_each_row_its_images(vl_dir: Path) -> None:
    """The actor's and the reference's passes through the worker group: the rows' images travel with them,
    and the log-probs equal a plain HF forward of each row (with the reference on: a KL loss)."""
    cfg = vl_config(vl_dir)
    cfg.actor.use_kl_loss = True
    components = build_components(cfg)
    try:
        batch = vision_batch(components.processor)
        model = load_causal_lm(vl_dir)
        want = hf_log_probs(model, batch, components.processor.image_token_id)
        got = components.actor.compute_log_prob(batch)["old_log_probs"]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        ref = components.ref.compute_ref_log_prob(batch)["ref_log_prob"]
        torch.testing.assert_close(ref, want, rtol=0, atol=1e-5)
    finally:
        components.close()


def test_a_text_policy_has_no_processor(tmp_path: Path) -> None:
    cfg = vl_config(tmp_path)
    cfg.model.path = None
    model, tokenizer = build_tiny_model_and_tokenizer()  # a text model handed in
    components = build_components(cfg, model, tokenizer)
    try:
        assert components.processor is None and components.groups[0].worker.processor is None
    finally:
        components.close()


def test_a_critic_with_a_vlm_is_refused(vl_dir: Path) -> None:
    cfg = vl_config(vl_dir)
    cfg.critic.enable = True
    with pytest.raises(UserError, match="critic"):
        build_components(cfg)
