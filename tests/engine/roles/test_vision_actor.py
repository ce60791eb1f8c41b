"""The actor on a vision-language model (tiny Qwen2.5-VL, float32, CPU): response log-probs of rows with
images of different sizes, two images in one prompt and text-only rows equal a plain HF forward of each row
(padded and packed, micro-batches with and without images); the frozen vision tower stays out of the
optimizer, a trained one is in it."""

from __future__ import annotations

import pytest
import torch
from support.dist_util import run_world_kept
from support.vision_batches import ROWS, hf_log_probs, vision_batch

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


def test_frozen_vision_tower_is_not_in_the_optimizer(tiny) -> None:
    """freeze_vision_tower (the default): the tower and merger are out of AdamW's groups; trained: in them."""
    for freeze in (True, False):
        engine = ActorEngine(
            build_tiny_vl_model_and_processor(seed=3)[0], ActorConfig(), freeze_vision_tower=freeze
        )
        optimized = {id(p) for group in engine.engine.optimizer.param_groups for p in group["params"]}
        named = dict(engine.module.named_parameters())
        tower = {n for n in named if ".visual." in n}
        assert tower and any(".merger." in n for n in tower)
        assert all((id(named[n]) in optimized) != freeze for n in tower)
        assert all(not named[n].requires_grad for n in tower) == freeze
        assert all(id(p) in optimized for n, p in named.items() if n not in tower)


def update_config() -> ActorConfig:
    cfg = ActorConfig()
    cfg.ppo_mini_batch_size = len(ROWS)  # one optimizer step over the whole batch
    cfg.ppo_micro_batch_size_per_gpu = 2  # rank 1 of 2 has a micro-batch of two text-only rows
    cfg.optim.lr = 1e-2
    cfg.optim.eps = (
        1e-3  # Adam's first step linear in tiny gradients: weights compare at 1e-6 (test_train_views)
    )
    cfg.grad_clip = 0.5
    return cfg


def update_on_ranks(rank: int, world: int) -> list[dict]:
    """One update of the tiny VLM on this rank's share of the batch, the tower trained and frozen."""
    from hybridflow.engine.parallel.fsdp import full_state_dict

    out = []
    for freeze in (False, True):
        lm, processor = build_tiny_vl_model_and_processor(seed=3)
        engine = ActorEngine(lm, update_config(), freeze_vision_tower=freeze)
        share = len(ROWS) // world
        batch = vision_batch(processor)[list(range(rank * share, (rank + 1) * share))]
        batch["old_log_probs"] = engine.compute_log_prob(batch, micro_batch_size=2)["log_probs"] - 0.05
        metrics = engine.update_policy(batch)
        tower = [p for n, p in engine.module.named_parameters() if ".visual." in n]
        no_grad = all(p.grad is None and not p.requires_grad for p in tower)
        state = {k: v.clone() for k, v in full_state_dict(engine.module).items()}
        out.append({"metrics": metrics, "state": state if rank == 0 else None, "tower_no_grad": no_grad})
    return out


def test_two_ranks_one_without_images_update_as_one_rank() -> None:
    """Rank 1's first micro-batch has no image: the dummy image keeps the tower's FSDP2 units in step (no hang)
    and adds exactly nothing, so both ranks' update equals one rank's on the whole batch (float32; the sums
    over ranks reorder additions: 1e-6 on the weights). Trained, the tower moves; frozen, it gets no gradient
    and keeps its weights."""
    initial = {f"lm.{k}": v for k, v in build_tiny_vl_model_and_processor(seed=3)[0].state_dict().items()}
    one = run_world_kept(1, update_on_ranks, 1)[0]
    two = run_world_kept(2, update_on_ranks, 2)
    for want, got in ((one[0], two[0][0]), (one[1], two[0][1])):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), key
        assert got["state"].keys() == want["state"].keys()
        for name, tensor in want["state"].items():
            torch.testing.assert_close(got["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    tower = [n for n in one[0]["state"] if ".visual." in n]
    assert any(not torch.equal(one[0]["state"][n], initial[n]) for n in tower)  # trained: it moved
    assert all(torch.equal(one[1]["state"][n], initial[n]) for n in tower)  # frozen: untouched
    assert one[1]["tower_no_grad"] and all(r[1]["tower_no_grad"] for r in two)


def test_an_image_pad_the_policy_sampled_in_its_response_scores_as_text(tiny) -> None:
    """A young policy samples the image pad like any token: in a response it is text (no image feature, a
    text position), as the rollout engine decoded it; the reference marks only the prompt's pads as image."""
    from hybridflow.models.vision import IMAGE_PAD

    model, processor = tiny
    pad = IMAGE_PAD
    rows = [([(56, 56)], "how many?", f"2{pad}"), ([], "hi", f"{pad}x"), ([(84, 56)], "red?", f"no{pad}")]
    batch = vision_batch(processor, rows=rows)
    assert (batch["responses"] == processor.image_token_id).sum() == 3
    want = torch.zeros_like(batch["responses"], dtype=torch.float32)
    body = model.model
    for b in range(len(rows)):
        valid = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][valid][None]  # (1, t)
        n = int(batch["response_mask"][b].sum())
        t = ids.shape[1]
        image = (ids == processor.image_token_id) & (torch.arange(t) < t - n)  # the prompt's pads only
        embeds = body.language_model.embed_tokens(ids)  # (1, t, H)
        mm = batch["multi_modal_inputs"][b]
        position_ids = None
        if mm is not None:
            feats = body.get_image_features(mm["pixel_values"], mm["image_grid_thw"]).pooler_output
            embeds = embeds.masked_scatter(
                image[..., None], torch.cat(list(feats)) if isinstance(feats, tuple) else feats
            )
            position_ids, _ = body.get_rope_index(ids, image.int(), mm["image_grid_thw"])
        with torch.no_grad():
            logits = model(inputs_embeds=embeds, position_ids=position_ids, use_cache=False).logits[0]
        logp = torch.log_softmax(logits.float(), -1)[t - n - 1 : t - 1]  # (n, V)
        want[b, :n] = logp.gather(-1, ids[0, t - n :, None])[:, 0]
    for packed in (False, True):
        engine = ActorEngine(
            build_tiny_vl_model_and_processor(seed=3)[0],
            ActorConfig(),
            use_remove_padding=packed,
            trainable=False,
        )
        got = engine.compute_log_prob(batch, micro_batch_size=2)["log_probs"]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
