"""SFT on image rows with a tiny Qwen2.5-VL: prompts encoded as the RL dataset encodes them, the step's loss equal to
a hand-written HF forward on the images, the tower frozen, the whole VLM saved, and the refusals."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.data.rl_dataset import RLDataset
from hybridflow.data.tasks import make_task
from hybridflow.engine import pack_prompt_response
from hybridflow.models.vision import batch_mrope_positions, build_tiny_vl_model_and_processor
from hybridflow.models.vision_tower import load_vision_processor
from hybridflow.trainer.builder import build_sft_components
from hybridflow.trainer.jobs import sft_job
from hybridflow.trainer.sft import SFTTrainer, encode_pairs, row_objects
from hybridflow.utils.errors import UserError
from hybridflow.workers.actor import ActorWorker

TEXT_ROW = {"prompt": [{"role": "user", "content": "how many squares are there?"}], "response": "three"}


def squares(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """Squares rows: boards of different colours and counts, the question's colour differs too."""
    return make_task("squares", split, n, seed, style="short")


def hf_conversational(row: dict) -> dict:
    """The same row in Hugging Face's conversational image format."""
    text = row["prompt"][0]["content"].replace("<image>", "")
    content = [{"type": "image"}, {"type": "text", "text": text}]
    return {**row, "prompt": [{"role": "user", "content": content}]}


def test_image_rows_encode_as_the_rl_dataset_does() -> None:
    """Same prompt ids (image pads expanded) and the same processed images, in verl's and HF's row formats."""
    _, processor = build_tiny_vl_model_and_processor()
    tok = processor.tokenizer
    rows = squares(6)
    assert (
        len({r["extra_info"]["answer"] for r in rows}) > 1
        and len({r["extra_info"]["color"] for r in rows}) > 1
    )
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for form in (rows, [hf_conversational(r) for r in rows]):
        prompts, responses, masks, images = encode_pairs(tok, [*form, TEXT_ROW], end, processor)
        rl = RLDataset(form, tok, max_prompt_length=256, processor=processor)
        for i, item in enumerate(rl):
            assert prompts[i] == item["input_ids"] and prompts[i].count(processor.image_token_id) > 1
            for key in ("pixel_values", "image_grid_thw"):
                assert torch.equal(images[i][key], item["multi_modal_inputs"][key])
            assert responses[i] == [
                *tok.encode(rows[i]["extra_info"]["answer"], add_special_tokens=False),
                end,
            ]
        assert images[-1] is None and processor.image_token_id not in prompts[-1]  # the text row
        assert masks[-1] == [1] * len(responses[-1])


def hf_nll(model: torch.nn.Module, batch, image_token_id: int) -> torch.Tensor:
    """Token-mean NLL of the responses by a plain HF forward with the images and M-RoPE positions."""
    ids, mask, responses = batch["input_ids"], batch["attention_mask"], batch["responses"]  # (B, T), (B, R)
    images = list(batch["multi_modal_inputs"])
    positions = batch_mrope_positions(ids, mask, images, image_token_id, 2)  # (3, B, T)
    shown = [m for m in images if m is not None]
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        pixel_values=torch.cat([m["pixel_values"] for m in shown]),
        image_grid_thw=torch.cat([m["image_grid_thw"] for m in shown]),
        mm_token_type_ids=(ids == image_token_id).int(),
    )
    R = responses.shape[1]
    log_probs = torch.log_softmax(out.logits.float(), -1)[:, -R - 1 : -1]  # (B, R, V)
    picked = log_probs.gather(-1, responses[..., None]).squeeze(-1)  # (B, R)
    m = batch["response_mask"]
    return -(picked * m).sum() / m.sum()


def sft_config(tmp: Path, steps: int, batch: int, *extra: str):
    return load_config(
        None,
        [
            f"trainer.default_local_dir={tmp}",
            f"trainer.total_training_steps={steps}",
            f"data.train_batch_size={batch}",
            f"actor.ppo_mini_batch_size={batch}",
            "actor.ppo_micro_batch_size_per_gpu=4",
            "actor.optim.weight_decay=0.0",
            "trainer.logger=[]",
            "trainer.save_freq=0",
            *extra,
        ],
    )


def one_step_loss(cfg, model, processor, rows, swap_images: bool = False) -> tuple[float, ActorWorker]:
    """One step of the SFT driver on a local group of one rank; its loss and the rank's actor."""
    components, data = build_sft_components(cfg, rows, model, processor.tokenizer, processor)
    if swap_images:  # the same grids, other pixels: only the images change
        data.images = [
            m if m is None else {**m, "pixel_values": m["pixel_values"].flip(0)} for m in data.images
        ]
    history = SFTTrainer(cfg, components, data).fit()
    return history[0]["sft/loss"], components.groups[0].worker.roles["actor"]


def test_one_sft_step_is_the_hf_nll_on_the_images(tmp_path: Path) -> None:
    """The step's loss is the HF forward's NLL with the images (a text row in the batch too); other pixels give
    another loss; the frozen tower does not move."""
    model, processor = build_tiny_vl_model_and_processor(seed=1)
    tok = processor.tokenizer
    rows = [*squares(7, seed=3), TEXT_ROW]
    cfg = sft_config(tmp_path, 1, len(rows))
    prompts, responses, _, images = encode_pairs(
        tok, rows, tok.convert_tokens_to_ids("<|im_end|>"), processor
    )
    batch = pack_prompt_response(prompts, responses, max(map(len, responses)), tok.pad_token_id)
    batch["multi_modal_inputs"] = row_objects(images)
    with torch.no_grad():
        want = hf_nll(copy.deepcopy(model), batch, processor.image_token_id).item()
    tower = {k: v.clone() for k, v in model.model.visual.state_dict().items()}
    loss, actor = one_step_loss(cfg, copy.deepcopy(model), processor, rows)
    assert loss == pytest.approx(want, abs=1e-5)
    trained = {k.split(".visual.", 1)[1]: v for k, v in actor.hf_state().items() if ".visual." in f".{k}"}
    assert trained.keys() == tower.keys() and all(torch.equal(trained[k], tower[k]) for k in tower)
    other, _ = one_step_loss(cfg, copy.deepcopy(model), processor, rows, swap_images=True)
    assert abs(other - loss) > 1e-4  # the images reach the model
    cfg.model.freeze_vision_tower = False  # asked for: the tower trains
    _, actor = one_step_loss(cfg, copy.deepcopy(model), processor, rows)
    trained = {k.split(".visual.", 1)[1]: v for k, v in actor.hf_state().items() if ".visual." in f".{k}"}
    assert any(not torch.equal(trained[k], tower[k]) for k in tower)


def held_out_accuracy(model, processor, rows: list[dict]) -> float:
    """Greedy answer digit after each prompt (its images shown) against the reference count."""
    ds = RLDataset(rows, processor.tokenizer, max_prompt_length=256, processor=processor)
    digits = torch.tensor([processor.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)])
    right = 0
    with torch.no_grad():
        for item in ds:
            ids = torch.tensor([item["input_ids"]])  # (1, T)
            mm = item["multi_modal_inputs"]
            positions = batch_mrope_positions(ids, torch.ones_like(ids), [mm], processor.image_token_id, 2)
            logits = model(
                input_ids=ids,
                position_ids=positions,
                pixel_values=mm["pixel_values"],
                image_grid_thw=mm["image_grid_thw"],
                mm_token_type_ids=(ids == processor.image_token_id).int(),
            ).logits[0, -1, digits]  # (10,)
            right += int(logits.argmax()) == int(item["ground_truth"])
    return right / len(ds)


def test_hybridflow_sft_on_image_rows_learns_and_saves_the_whole_vlm(tmp_path: Path) -> None:
    """``hybridflow sft`` with a VLM directory and the squares task (its processor loaded from model.path): the
    held-out count accuracy rises above chance, and the saved directory is the whole VLM with its processor,
    tower unchanged."""
    from transformers import AutoModelForImageTextToText

    from hybridflow.cli.main import main

    base, _ = build_tiny_vl_model_and_processor(tmp_path / "base", seed=0)
    out = tmp_path / "sft"
    # 250 steps of 32 (about 17 epochs of 480 rows), about 9 s: held-out 0.92-1.0 over seeds 0-2 (30 steps of 16
    # stay at chance, the digit's NLL near ln 4; 150 steps at lr 2e-3 give 0.58-0.98).
    overrides = [
        f"model.path={tmp_path / 'base'}",
        "data.task=squares",
        "data.task_kwargs.style=short",
        "data.task_train_size=480",
        "trainer.total_training_steps=250",
        "trainer.seed=0",
        "data.train_batch_size=32",
        "actor.ppo_mini_batch_size=32",
        "actor.ppo_micro_batch_size_per_gpu=32",
        "actor.optim.lr=1e-3",
        "actor.optim.weight_decay=0.0",
        "trainer.logger=[]",
        f"trainer.default_local_dir={tmp_path}",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # 250 small steps: on a loaded 2-core machine extra threads only spin (30x slower)
    try:
        assert main(["sft", *overrides, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (out / "preprocessor_config.json").is_file() and (out / "tokenizer.json").is_file()
    trained = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    tower = base.model.visual.state_dict()
    assert all(torch.equal(v, tower[k]) for k, v in trained.model.visual.state_dict().items())
    processor = load_vision_processor(out, build_tiny_vl_model_and_processor()[1].tokenizer, trained.config)
    accuracy = held_out_accuracy(trained, processor, squares(64, seed=1, split="test"))
    assert accuracy > 0.6, accuracy  # answers are even over 0-3: chance is 1 in 4


def test_image_rows_are_refused_without_a_vlm_and_its_processor(tmp_path: Path) -> None:
    from hybridflow.models.tiny import build_tiny_model_and_tokenizer

    rows = [TEXT_ROW, *squares(2)]
    text_model, tok = build_tiny_model_and_tokenizer()
    with pytest.raises(
        UserError, match=r"SFT row 1 .*has images but the model has no image processor.*vision-lan"
    ):
        sft_job(sft_config(tmp_path, 1, 2), tmp_path / "a", text_model, tok, rows)
    vlm, processor = build_tiny_vl_model_and_processor()
    with pytest.raises(UserError, match=r"SFT row 1 .*no image processor; pass the model's processor"):
        sft_job(sft_config(tmp_path, 1, 2), tmp_path / "b", vlm, processor.tokenizer, rows)
    bare = tmp_path / "bare"
    vlm.save_pretrained(bare)  # the model without its image processor's files
    with pytest.raises(UserError, match=r"without preprocessor_config.json"):
        sft_job(
            sft_config(tmp_path, 1, 2, f"model.path={bare}"), tmp_path / "c", vlm, processor.tokenizer, rows
        )
    assert not any((tmp_path / name).exists() for name in "abc")
