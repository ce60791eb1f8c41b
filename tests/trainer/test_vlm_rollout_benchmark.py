"""benchmarks/vlm_rollout.py runs end to end on the CPU (``--tiny``), so the GPU benchmark cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_tiny_run_reports_the_engine_and_hf_generate_over_image_prompts(tmp_path: Path, capsys) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import vlm_rollout
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = tmp_path / "results.jsonl"
    records = vlm_rollout.main(["--tiny", "--out", str(out)])
    assert records == [json.loads(line) for line in out.read_text().splitlines()]
    engine, hf = records
    assert engine["engine"] == "paged" and hf["engine"] == "hf"
    assert engine["tokens"] == hf["tokens"] == 3 * 6  # ignore_eos: every prompt samples its tokens
    assert engine["image_prefills"] == 3 and engine["image_tokens"] == 4  # a 56 x 56 image: 2 x 2 merged
    assert engine["tokens_per_s"] > 0 and hf["tokens_per_s"] > 0 and engine["over_hf"] > 0
    assert engine["vision_s"] > 0
    assert "x HF" in capsys.readouterr().out
