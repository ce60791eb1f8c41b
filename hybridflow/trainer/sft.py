"""Supervised fine-tuning on prompt/response pairs, driven like RL: a dataflow of stages on the worker groups.

The driver encodes the rows once (``encode_pairs``: chat prompts, responses ending with the chat end token,
loss masks that leave out a conversation's tool turns, a VLM's images) and keeps them (``SFTData``). A step
(``SFTTrainer``) samples a batch of rows and runs two stages: ``collate`` packs them (prompts left-padded,
responses right-padded) and ``update_actor`` takes one optimizer step of the token-mean NLL of the responses on
the actor's group, each model replica on its share of the rows (``workers.group``), so the same code trains on
one rank, torchrun's ranks or Ray actors, in any training view of the actor. Checkpoints, resume and the
metrics are the training loop's (``trainer.loop``), as for RL.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.config.schema import Config
from hybridflow.data import PromptSampler
from hybridflow.data.images import MULTI_MODAL_KEY
from hybridflow.data.rl_dataset import encode_image_prompt, has_images
from hybridflow.data.rows import RowOrigin
from hybridflow.data.sft_turns import check_conversation, encode_conversation, is_conversation
from hybridflow.engine import pack_prompt_response, pad_rows
from hybridflow.protocol import Batch
from hybridflow.trainer.dataflow import Dataflow, Stage
from hybridflow.trainer.loop import TrainingLoop
from hybridflow.trainer.metrics import step_peak_memory, throughput_metrics
from hybridflow.trainer.tracking import Tracker
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

TEXT_MODEL_FIX = (
    "SFT on images needs a vision-language model (Qwen2-VL / Qwen2.5-VL) with its processor; point model.path "
    "to one, or drop the rows' 'images' column"
)
VLM_PROCESSOR_FIX = (
    "pass the model's processor (sft_job(..., processor=...)), or save its image processor "
    "(preprocessor_config.json) in model.path"
)


def encode_pairs(
    tokenizer: Any,
    rows: list[dict],
    end_token_id: int,
    processor: Any = None,
    image_fix: str = TEXT_MODEL_FIX,
    image_key: str = "images",
) -> tuple[list[list[int]], list[list[int]], list[list[int]], list[dict | None]]:
    """Chat-template prompt ids, response ids (ending with the chat end token), loss masks and images of each row.

    A row has ``prompt`` (chat messages or text) and ``response`` (text), or the built-in tasks' reference
    answer in ``extra_info.answer``; its mask is all ones. A row whose ``messages`` hold tool turns and that has
    no ``response`` is a conversation (``data.sft_turns``): the response runs to the end of its last assistant turn and the mask
    is 1 on the assistant turns only (tool results and headers between them are 0).

    A row with images (an ``images`` column with ``<image>`` placeholders, or Hugging Face's ``{"type":
    "image"}`` items) needs a vision-language model's ``processor``: its prompt is encoded exactly as the RL
    dataset encodes it (image pads expanded) and its images (``{"pixel_values", "image_grid_thw"}``, processed
    once) are the row's entry in the fourth list, None for text rows. Without a processor such a row is refused
    with ``image_fix`` as the way out. ``image_key``: the images column (``data.image_key`` for files).
    """
    prompts, responses, masks, images = [], [], [], []
    origins = getattr(rows, "origins", None) or [RowOrigin("SFT rows", i) for i in range(len(rows))]
    for i, row in enumerate(rows):
        if isinstance(row, dict) and has_images(row, image_key=image_key):
            if processor is None or is_conversation(row):
                why = "the model has no image processor" if processor is None else "it is a tool conversation"
                raise UserError(
                    f"SFT row {i} ({origins[i].describe()}) has images but {why}; "
                    + (image_fix if processor is None else "SFT on tool conversations takes text rows only")
                )
            ids, mm = encode_image_prompt(tokenizer, processor, row, origins[i], image_key=image_key)
            prompts.append(ids)
            responses.append(
                [*tokenizer.encode(_response_of(row, i), add_special_tokens=False), end_token_id]
            )
            masks.append([1] * len(responses[-1]))
            images.append(mm)
            continue
        images.append(None)
        if is_conversation(row):
            turns = check_conversation(row["messages"], origins[i])
            ids, response, mask = encode_conversation(tokenizer, turns, origins[i])
            prompts.append(ids)
            responses.append(response)
            masks.append(mask)
            continue
        response = _response_of(row, i)
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            ids = tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        prompts.append(list(ids))
        responses.append([*tokenizer.encode(response, add_special_tokens=False), end_token_id])
        masks.append([1] * len(responses[-1]))
    return prompts, responses, masks, images


def row_objects(values: list[Any]) -> np.ndarray:
    """A 1-D object array of ``values`` (filled one by one so each dict stays one element)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _response_of(row: Any, i: int) -> str:
    """The row's target: ``response``, else the built-in tasks' ``extra_info.answer``; refused when missing."""
    prompt = row.get("prompt") if isinstance(row, dict) else None
    response = (row.get("response") or (row.get("extra_info") or {}).get("answer")) if prompt else None
    if not isinstance(response, str) or not response:
        raise UserError(
            f"SFT row {i} needs a non-empty 'prompt' and a 'response' (or extra_info.answer), or "
            "'messages' with tool and assistant turns"
        )
    return response


SEQ_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


@dataclass
class SFTData:
    """The encoded rows (``encode_pairs``' four lists); every batch pads its responses to the longest of all."""

    prompts: list[list[int]]
    responses: list[list[int]]
    masks: list[list[int]]
    images: list[dict | None]

    def __post_init__(self) -> None:
        self.width = max(len(r) for r in self.responses)

    @classmethod
    def encode(
        cls,
        tokenizer: Any,
        rows: list[dict],
        stop_tokens: list[int],
        processor: Any,
        vlm: bool,
        image_key: str,
    ) -> SFTData:
        """``encode_pairs`` of ``rows``, each response ending with the policy's last stop token (a chat model's
        end token); an image row without a ``processor`` is refused with the way out that fits the model
        (``vlm``: a vision-language model without its image processor)."""
        fix = VLM_PROCESSOR_FIX if vlm else TEXT_MODEL_FIX
        return cls(*encode_pairs(tokenizer, rows, stop_tokens[-1], processor, fix, image_key))

    def __len__(self) -> int:
        return len(self.prompts)

    def collate(self, indices: list[int], pad_token_id: int) -> Batch:
        """The rows ``indices`` packed (``pack_prompt_response``), the masks applied, a VLM's images attached."""
        prompts, responses = [self.prompts[i] for i in indices], [self.responses[i] for i in indices]
        batch = pack_prompt_response(prompts, responses, self.width, pad_token_id)
        # tool results and turn headers inside a response are never trained on
        trained, _ = pad_rows([self.masks[i] for i in indices], self.width, 0, torch.float32)  # (b, R)
        batch["response_mask"] = batch["response_mask"] * trained
        if any(self.images[i] is not None for i in indices):  # (b,) dicts or None, aligned with the rows
            batch[MULTI_MODAL_KEY] = row_objects([self.images[i] for i in indices])
        return batch


def check_sft_config(cfg: Config) -> None:
    """Refuse what SFT does not do: ``trainer.val_only`` (it never validates)."""
    if cfg.trainer.val_only:
        raise UserError(
            "trainer.val_only=true: hybridflow sft trains and does not validate; set trainer.val_only=false, "
            "or evaluate the model with hybridflow eval"
        )


class SFTTrainer(TrainingLoop):
    """Drives SFT on the actor's worker group: ``components.total_steps`` optimizer steps of
    ``data.train_batch_size`` rows each, in a seeded order (epoch after epoch); checkpoints and resume as every
    driver (``TrainingLoop``). A VLM's images ride along with their rows (``multi_modal_inputs``)."""

    def __init__(self, cfg: Config, components: Any, data: SFTData, tracker: Tracker | None = None) -> None:
        check_sft_config(cfg)
        super().__init__(cfg, components, tracker)
        self.data = data
        self.sampler = PromptSampler(len(data), cfg.data.train_batch_size, cfg.trainer.seed, shuffle=True)
        self.dataflow = Dataflow(
            [
                Stage("collate", ("index",), SEQ_KEYS, self._collate, replaces_batch=True),
                Stage("update_actor", SEQ_KEYS, (), self._update),
            ],
            inputs=("index",),
            keep=("attention_mask",),  # the step's throughput counts its tokens
        )

    def step(self) -> dict[str, float]:
        """One optimizer step on the sampler's next batch of rows."""
        start = time.perf_counter()
        metrics: dict[str, float] = {"training/global_step": float(self.global_step)}
        batch = Batch({"index": torch.tensor(self.sampler.next_batch())})
        batch = self.dataflow.run(batch, metrics)
        elapsed = time.perf_counter() - start
        memory = self.c.actor.memory()
        metrics.update(memory)
        metrics.update(throughput_metrics(batch, elapsed, self.cfg.trainer.world_size))
        metrics.update(step_peak_memory(memory))
        return metrics

    def _collate(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        return self.data.collate(batch["index"].tolist(), self.c.pad_token_id)

    def _update(self, batch: Batch, metrics: dict[str, float]) -> None:
        metrics.update(self.c.actor.update_sft(batch))
