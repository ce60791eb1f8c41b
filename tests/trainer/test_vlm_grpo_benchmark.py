"""benchmarks/vlm_grpo.py runs end to end on the CPU (``--tiny``), so the GPU benchmark of issue 47 cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def import_benchmark():
    """The benchmark module (its siblings importable while it loads)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import vlm_grpo
    finally:
        sys.path.remove(str(BENCHMARKS))
    return vlm_grpo


def test_tiny_run_trains_on_image_prompts_and_reports_the_step(tmp_path: Path, capsys) -> None:
    vlm_grpo = import_benchmark()
    out = tmp_path / "results.jsonl"
    record = vlm_grpo.main(["--tiny", "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text().splitlines()[-1]) == record
    assert record["shape"] == "tiny" and record["image_tokens"] == 9  # an 84 x 84 board: 3 x 3 merged tokens
    for key in ("timing_s/gen", "timing_s/update_actor", "perf/time_per_step", "perf/rollout_tokens_per_s"):
        assert record[key] > 0, key
    assert record["rollout/decode_tokens"] == 2 * 2 * 3  # ignore_eos: 4 tokens, the first from prefill
    assert record["rollout/kv_slots"] > 0  # the built-in paged engine ran (not HF generate's fallback)
    # prompts x samples x (prompt + 4): every prompt holds its 9 image tokens and the question
    assert 2 * 2 * (9 + 4 + 20) < record["perf/total_num_tokens"] < 2 * 2 * (9 + 4 + 96)
    assert 0 < record["mfu/update_actor"] < 1
    printed = capsys.readouterr().out
    assert "step 1 (timed)" in printed and "timing_s/update_actor" in printed and "machine: " in printed


def test_the_3b_tokenizer_covers_the_vocabulary_with_qwen_vision_ids() -> None:
    """Every id of the 151,936-row embedding decodes; the vision tokens sit at Qwen2.5-VL's ids, unsplit."""
    vlm_grpo = import_benchmark()
    tok = vlm_grpo.qwen_vl_tokenizer(151936, 4096)
    assert len(tok) == 151936
    ids = [tok.convert_tokens_to_ids(t) for t in vlm_grpo.VISION_TOKENS]
    assert ids == [151652, 151653, 151655, 151656]
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many red squares?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    encoded = tok(text)["input_ids"]
    assert encoded.count(151655) == 1 and encoded.index(151652) + 1 == encoded.index(151655)
    assert tok.decode(encoded) == text  # chars round-trip
    assert tok.decode([151000, 151935], skip_special_tokens=True) == "<f151000><f151935>"
