"""Datasets from the ``data`` config section: the configured files, or the built-in task when there are none."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridflow.config import DataConfig
from hybridflow.data.rl_dataset import RLDataset
from hybridflow.data.rows import BUILT_IN, Rows, load_rows
from hybridflow.data.tasks import make_task
from hybridflow.data.user_rows import as_rows
from hybridflow.utils.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_split_rows(
    data: DataConfig, split: str, seed: int, task_kwargs: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Rows of 'train' or 'val': ``data.train_files``/``val_files``, else the built-in task's train/test split."""
    if split not in ("train", "val"):
        raise UserError(f"split must be 'train' or 'val', got {split!r}")
    files = data.train_files if split == "train" else data.val_files
    if files:  # the notebook API's rows too: a file gives the same prompts on both paths
        return as_rows(load_rows(files), data.prompt_key, data.reward_fn_key)[0]
    size = data.task_train_size if split == "train" else data.task_val_size
    task_split = "train" if split == "train" else "test"
    rows = make_task(data.task, task_split, size, seed, **{**data.task_kwargs, **(task_kwargs or {})})
    return Rows(rows)


def build_rl_dataset(
    data: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    split: str,
    seed: int,
    task_kwargs: dict[str, Any] | None = None,
    processor: Any = None,
) -> RLDataset:
    """The RL prompt dataset of ``split`` ('train' or 'val') with the config's length and truncation rules.

    ``processor``: a vision-language model's (``models.vision.VisionProcessor``), for rows with images.
    """
    rows = load_split_rows(data, split, seed, task_kwargs)
    files = data.train_files if split == "train" else data.val_files
    source = None if files else f"{BUILT_IN} {data.task} ({split})"
    # The built-in tasks keep their images in "images" whatever data.image_key names in files.
    return dataset_from_rows(data, rows, tokenizer, source, processor, data.image_key if files else "images")


def dataset_from_rows(
    data: DataConfig,
    rows: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    source: str | None,
    processor: Any = None,
    image_key: str | None = None,
) -> RLDataset:
    """An RLDataset over ``rows`` with the config's prompt key, length and truncation rules (and images)."""
    return RLDataset(
        rows,
        tokenizer,
        prompt_key=data.prompt_key,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        filter_overlong_prompts=data.filter_overlong_prompts,
        source=source,
        reward_fn_key=data.reward_fn_key,
        template_text_prompts=data.template_text_prompts,
        processor=processor,
        image_key=data.image_key if image_key is None else image_key,
    )
