"""L2 data: RL prompt datasets (parquet/jsonl, chat templates), SFT datasets, a resumable sampler and
built-in synthetic tasks (arithmetic, countdown, multiply: answered with the calc tool) in verl's row schema.

    rows = load_rows("train.parquet")           # or make_task("arithmetic", "train", size=2000, seed=0)
    ds = RLDataset(rows, tokenizer, max_prompt_length=128)
    sampler = PromptSampler(len(ds), batch_size=16, seed=42)
    batch = collate_prompts([ds[i] for i in sampler.next_batch()], tokenizer.pad_token_id)
"""

from hybridflow.data.builder import build_rl_dataset, load_split_rows
from hybridflow.data.rl_dataset import TRUNCATIONS, RLDataset, collate_prompts, encode_prompts, truncate
from hybridflow.data.rows import DataError, RowOrigin, Rows, load_rows, save_rows
from hybridflow.data.sampler import PromptSampler
from hybridflow.data.sft_dataset import SFTDataset, collate_sft, render_response
from hybridflow.data.squares import make_squares
from hybridflow.data.tasks import TASKS, in_test_split, make_arithmetic, make_countdown, make_task

__all__ = [
    "TASKS",
    "TRUNCATIONS",
    "DataError",
    "PromptSampler",
    "RLDataset",
    "RowOrigin",
    "Rows",
    "SFTDataset",
    "build_rl_dataset",
    "collate_prompts",
    "collate_sft",
    "encode_prompts",
    "in_test_split",
    "load_rows",
    "load_split_rows",
    "make_arithmetic",
    "make_countdown",
    "make_squares",
    "make_task",
    "render_response",
    "save_rows",
    "truncate",
]

from hybridflow.data.preference_dataset import (
    PREFERENCE_TRUNCATIONS,
    KTODataset,
    PreferenceDataset,
    collate_kto,
    collate_pairs,
    make_arithmetic_preferences,
)

__all__ += [
    "PREFERENCE_TRUNCATIONS",
    "KTODataset",
    "PreferenceDataset",
    "collate_kto",
    "collate_pairs",
    "make_arithmetic_preferences",
]
