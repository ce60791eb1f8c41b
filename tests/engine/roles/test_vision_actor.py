"""The actor on a vision-language model (tiny Qwen2.5-VL, float32, CPU): response log-probs of rows with
images of different sizes, two images in one prompt and text-only rows equal a plain HF forward of each row
(padded and packed, micro-batches with and without images); the frozen vision tower stays out of the
optimizer, a trained one is in it."""

from __future__ import annotations

import pytest
import torch
from vision_batches import hf_log_probs, vision_batch

from hybridflow.config.schema import ActorConfig
from hybridflow.engine.roles.actor import ActorEngine
from hybridflow.models.vision import build_tiny_vl_model_and_processor


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_vl_model_and_processor(seed=3)


@pytest.mark.parametrize("packed", [False, True])
def test_log_probs_with_images_equal_a_plain_hf_forward_per_row(tiny, packed: bool) -> None:
    """Micro-batches of 2: [image, text], [image, two images], [text, text] (the dummy image), [image, text]."""
    model, processor = tiny
    batch = vision_batch(processor)
    want = hf_log_probs(model, batch, processor.image_token_id)
    lm = build_tiny_vl_model_and_processor(seed=3)[0]
    engine = ActorEngine(lm, ActorConfig(), use_remove_padding=packed, trainable=False)
    got = engine.compute_log_prob(batch, micro_batch_size=2)["log_probs"]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got[batch["response_mask"] == 0] == 0).all()
