"""benchmarks/agent_loop.py runs end to end on the CPU (``--tiny``, the endpoint too), so the GPU benchmark
cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_tiny_run_reports_both_throughputs_over_the_same_tokens(tmp_path: Path, capsys) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import agent_loop
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = tmp_path / "results.jsonl"
    argv = ["--tiny", "--warmup", "0", "--sleep-ms", "1", "5", "--endpoint", "--out", str(out)]
    record = agent_loop.main(argv)
    assert record == json.loads(out.read_text().splitlines()[-1])
    assert record["episodes"] == 4 and record["tool_call_counts/mean"] > 0 and record["num_turns/mean"] > 1
    assert record["single_turn/tokens"] == record["sampled_tokens"] > 0  # the same tokens, single-turn
    assert record["tool_tokens"] > 0 and record["tool/sleep_s_total"] > 0
    assert record["multi_turn/engine_sessions"] >= 1 and 0 <= record["multi_turn/prefix_cache_hit_rate"] <= 1
    for key in ("multi_turn/sampled_tokens_per_s", "single_turn/tokens_per_s", "multi_over_single"):
        assert record[key] > 0, key
    # the same episodes through the OpenAI endpoint: every turn continued its row (no split), several turns
    assert record["endpoint/splits"] == 0 and record["endpoint/turns"] > 1 and record["endpoint/sampled"] > 0
    assert record["endpoint_over_loop"] > 0
    assert "ratio" in capsys.readouterr().out
