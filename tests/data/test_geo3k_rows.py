"""verl's geo3k rows (hiyouga/geometry3k preprocessed: '<image>' prompt, PNG bytes) load and score."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image, ImageDraw

from hybridflow.config import DataConfig
from hybridflow.data import collate_prompts
from hybridflow.data.builder import build_rl_dataset
from hybridflow.rewards import default_compute_score

# verl's examples/data_preprocess/geo3k.py appends this instruction to each problem.
INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
PROBLEMS = [  # (problem, ground truth, image size)
    ("Find x.", "3 \\sqrt { 3 }", (140, 98)),
    ("Find the area of the triangle. Round to the nearest tenth if necessary.", "65", (112, 112)),
    (
        "In \\odot P, the radius is 2 inches, find the length of \\widehat RS.",
        "\\frac { 4 } { 3 } \\pi",
        (84, 168),
    ),
]


def _figure(size: tuple[int, int], seed: int) -> bytes:
    """A PNG of a triangle (a geometry figure as the dataset's images are)."""
    image = Image.new("RGB", size, "white")
    w, h = size
    ImageDraw.Draw(image).polygon([(4 + seed, h - 5), (w - 5, h - 5), (w // 2, 4)], outline="black", width=2)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _geo3k_rows() -> list[dict]:
    return [
        {
            "data_source": "hiyouga/geometry3k",
            "prompt": [{"role": "user", "content": f"<image>{problem} {INSTRUCTION}"}],
            "images": [{"bytes": _figure(size, i)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": i, "answer": truth, "question": f"<image>{problem}"},
        }
        for i, (problem, truth, size) in enumerate(PROBLEMS)
    ]


def test_geo3k_parquet_loads_and_scores(tmp_path, vl_processor) -> None:
    """The parquet file goes through data.train_files with the processor; the boxed answers score by geo3k's route."""
    path = tmp_path / "geo3k_train.parquet"
    pq.write_table(pa.Table.from_pylist(_geo3k_rows()), path)
    data = DataConfig(train_files=[str(path)], max_prompt_length=1024)
    ds = build_rl_dataset(data, vl_processor.tokenizer, "train", seed=0, processor=vl_processor)
    assert len(ds) == len(PROBLEMS) and ds.data_sources() == ["hiyouga/geometry3k"]
    batch = collate_prompts([ds[i] for i in range(len(ds))], vl_processor.tokenizer.pad_token_id)
    for b, row in enumerate(_geo3k_rows()):
        image = Image.open(io.BytesIO(row["images"][0]["bytes"]))
        grid = vl_processor.images_to_inputs([image.convert("RGB")])["image_grid_thw"]  # (1, 3)
        mm = batch.non_tensors["multi_modal_inputs"][b]
        assert torch.equal(mm["image_grid_thw"], grid)
        image_tokens = int((batch.tensors["input_ids"][b] == vl_processor.image_token_id).sum())
        assert image_tokens == int(grid.prod()) // vl_processor.merge_size**2
    grids = {tuple(mm["image_grid_thw"][0].tolist()) for mm in batch.non_tensors["multi_modal_inputs"]}
    assert len(grids) == len(PROBLEMS)  # each figure at its own size
    assert [it["extra_info"]["index"] for it in ds.items] == [0, 1, 2]
    right = [
        "<think>30-60-90</think> \\boxed{3\\sqrt{3}}",
        "\\boxed{65}",
        "<think>.</think>\\boxed{\\frac{4}{3}\\pi}",
    ]
    for item, response in zip(ds.items, right):
        assert default_compute_score(item["data_source"], response, item["ground_truth"]) == 1.0
        assert default_compute_score(item["data_source"], "\\boxed{7}", item["ground_truth"]) == 0.0
