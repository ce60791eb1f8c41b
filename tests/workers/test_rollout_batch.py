"""The rollout stage hands each prompt row's images (the non-tensor field ``multi_modal_inputs``, None on a
text-only row) to the engine: a batch of image prompts and a text-only one through ``sample_batch`` on a tiny
Qwen2.5-VL gives the engine's own samples, each sample row carrying its prompt's images (the same objects)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.vlm_cases import lively_vl_model, prompts

from hybridflow.engine import SamplingParams
from hybridflow.engine.parallel.rollout_group import RolloutGroup
from hybridflow.engine.parallel.view import GenerateView
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.protocol import Batch
from hybridflow.utils.errors import UserError
from hybridflow.workers.rollout_batch import sample_batch


def prompt_batch(ids: list[list[int]], mms: list) -> Batch:
    """Left-padded prompt rows as the data layer gives them, images as a numpy object array."""
    width = max(map(len, ids))
    x = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, p in enumerate(ids):
        x[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    images = np.empty(len(mms), dtype=object)
    images[:] = mms
    return Batch({"input_ids": x, "attention_mask": mask}, {"multi_modal_inputs": images})


def test_sample_batch_passes_each_rows_images_to_the_engine() -> None:
    model, processor = lively_vl_model()
    ids, mms = prompts(processor)
    params = SamplingParams(n=2, max_new_tokens=6, do_sample=False)
    group = RolloutGroup(GenerateView(1), 0)
    batch = sample_batch(PagedEngine(model, block_size=8), group, prompt_batch(ids, mms), params, 6, 0)
    want = PagedEngine(model, block_size=8).generate(ids, params, mm_inputs=mms)
    responses = [row[m.bool()].tolist() for row, m in zip(batch["responses"], batch["response_mask"])]
    assert responses == [s.token_ids for g in want for s in g]
    rows = batch.non_tensors["multi_modal_inputs"]
    assert [mm is mms[i // 2] for i, mm in enumerate(rows)] == [True] * 6  # shared, never copied


def test_images_for_a_text_model_are_refused() -> None:
    from hybridflow.models.tiny import build_tiny_model

    _, processor = lively_vl_model()
    ids, mms = prompts(processor)
    model = build_tiny_model("qwen2", vocab_size=300, hidden_size=32, num_hidden_layers=1).eval()
    group = RolloutGroup(GenerateView(1), 0)
    with pytest.raises(UserError, match="multi_modal_inputs"):
        sample_batch(PagedEngine(model, block_size=8), group, prompt_batch(ids, mms), SamplingParams(), 4, 0)
