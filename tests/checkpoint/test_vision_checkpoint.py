"""Checkpoints and export of a vision-language actor (tiny Qwen2.5-VL, vision tower trained so that it moves):
resume restores the whole model (log-probs on image prompts equal), and ``export_hf`` writes the whole VLM with
its processor files, which load back (transformers and our loader) and give the trainer's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.vision_batches import ROWS, hf_log_probs, image, vision_batch
from transformers import AutoModelForImageTextToText

from hybridflow.checkpoint import RoleState, export_hf, load, save, write_hf_config
from hybridflow.checkpoint.manager import HF_CONFIG
from hybridflow.config.schema import ActorConfig
from hybridflow.engine.parallel.fsdp import full_state_dict
from hybridflow.engine.roles.actor import ActorEngine
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.models.vision import build_tiny_vl_model_and_processor
from hybridflow.models.vision_tower import load_vision_processor


def engine_of(seed: int, freeze: bool) -> tuple[ActorEngine, object]:
    cfg = ActorConfig()
    cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu = len(ROWS), 4
    cfg.optim.lr = 1e-2
    lm, processor = build_tiny_vl_model_and_processor(seed=seed)
    return ActorEngine(lm, cfg, freeze_vision_tower=freeze), processor


@pytest.mark.parametrize("freeze", [False, True])
def test_a_vlm_checkpoint_resumes_and_exports_the_whole_model_with_its_processor(
    tmp_path: Path, freeze: bool
) -> None:
    """Trained tower: it moved, and comes back; frozen: it is saved and restored without optimizer state."""
    engine, processor = engine_of(3, freeze)
    batch = vision_batch(processor)
    engine.update_policy(batch)  # on-policy
    roles = {"actor": RoleState(engine.module, engine.engine.optimizer, "lm.")}

    def extras(tmp: Path) -> None:
        write_hf_config(tmp / "actor" / HF_CONFIG, engine.module.lm, processor)

    ckpt = save(tmp_path / "run", 1, roles, {}, {}, write_extras=extras)
    saved = engine.compute_log_prob(batch, micro_batch_size=4)["log_probs"]
    state = {k.removeprefix("lm."): v.clone() for k, v in full_state_dict(engine.module).items()}
    initial = build_tiny_vl_model_and_processor(seed=3)[0].state_dict()
    moved = [not torch.equal(state[k], initial[k]) for k in state if ".visual." in k]
    assert (not any(moved)) if freeze else any(moved)

    fresh, _ = engine_of(7, freeze)  # other weights: everything must come from the checkpoint
    load(ckpt, {"actor": RoleState(fresh.module, fresh.engine.optimizer, "lm.")})
    torch.testing.assert_close(
        fresh.compute_log_prob(batch, micro_batch_size=4)["log_probs"], saved, rtol=0, atol=1e-6
    )

    out = export_hf(ckpt, tmp_path / "hf")
    assert (out / "preprocessor_config.json").is_file() and (out / "tokenizer.json").is_file()
    exported = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert type(exported).__name__ == "Qwen2_5_VLForConditionalGeneration"
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)
    trained = build_tiny_vl_model_and_processor(seed=3)[0]
    trained.load_state_dict(state)
    row = batch[[3]]  # two images
    mm = row["multi_modal_inputs"][0]
    ids = row["input_ids"][:, row["attention_mask"][0].bool()]
    kwargs = dict(input_ids=ids, pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"])
    kwargs["mm_token_type_ids"] = (ids == processor.image_token_id).int()
    with torch.no_grad():
        torch.testing.assert_close(exported(**kwargs).logits, trained(**kwargs).logits, rtol=0, atol=0)
    torch.testing.assert_close(
        hf_log_probs(exported, batch, processor.image_token_id), saved, rtol=0, atol=1e-5
    )

    lm = load_causal_lm(out)  # and through our loader: the VLM class and its processor
    reloaded = load_vision_processor(out, load_tokenizer(out), lm.config)
    assert type(lm).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert reloaded.image_token_id == processor.image_token_id and reloaded.merge_size == processor.merge_size
    first = processor.images_to_inputs([image((84, 56), 1)])
    again = reloaded.images_to_inputs([image((84, 56), 1)])
    torch.testing.assert_close(again["pixel_values"], first["pixel_values"], rtol=0, atol=0)
