"""benchmarks/grpo_step.py runs end to end on the CPU (a tiny shape), so the GPU benchmark cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_step.py"


def torch_cuda() -> bool:
    """Whether a GPU is there (torch imported only when asked)."""
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
def test_w2_smoke_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    args = ["--workload", "W2", "--model-size", "tiny", "--device", "cpu", "--prompts", "2"]
    args += ["--prompt-len", "12", "--new-tokens", "6", "--steps", "1", "--warmup", "1", "--out", str(out)]
    # A fresh process group: this process may hold one already, whose port the child would try to bind.
    dist_vars = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    cmd = [sys.executable, str(SCRIPT), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text().splitlines()[-1])
    for key in ("timing_s/gen", "timing_s/ref", "timing_s/update_actor", "perf/throughput"):
        assert record[key] > 0, key
    assert record["perf/total_num_tokens"] == 2 * 8 * (12 + 6)  # prompts x samples x (prompt + response)
    assert record["rollout/decode_tokens"] == 2 * 8 * 5  # every sample's first token comes from prefill
    assert 0 < record["perf/rollout_decode_roofline_fraction"] < 1
    assert 0 < record["mfu/update_actor"] < 1
    assert "perf/throughput" in done.stdout
    assert "machine: " in done.stdout and record["machine"]["host_cores"] == str(os.cpu_count())


def test_the_7b_shape_builds_untied_and_its_decode_bytes_count_the_head_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--model-size 7b`` is Qwen2-7B (on the meta device here: shapes only; the GPU run is the lead's)."""
    import torch

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import grpo_step
    from shapes import build_model, count_params

    model = build_model("7b", "sdpa", torch.device("meta"))
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size) == (
        3584,
        28,
        18944,
        152064,
    )
    assert (c.num_attention_heads, c.num_key_value_heads, c.tie_word_embeddings) == (28, 4, False)
    total, _ = count_params(model)
    assert model.lm_head.weight is not model.model.embed_tokens.weight and round(total / 1e9, 2) == 7.62
    weights, _ = grpo_step.decode_bytes(model)
    assert weights == (total - c.vocab_size * c.hidden_size) * 2  # every weight but the input embedding, once
    tied = build_model("0.5b", "sdpa", torch.device("meta"))
    assert tied.config.tie_word_embeddings and grpo_step.decode_bytes(tied)[0] == count_params(tied)[0] * 2


def test_the_gpu_memory_cap_takes_gib_above_0_and_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--gpu-memory-gb`` of grpo_step.py and switch.py (in-process: the argument type and the cap)."""
    import argparse

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gpu_clocks import cap_gpu_memory, gpu_memory_gb

    assert gpu_memory_gb("80") == 80.0 and gpu_memory_gb("23.5") == 23.5
    for bad in ("0", "-8", "nan", "inf", "eighty"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected GiB of GPU memory above 0"):
            gpu_memory_gb(bad)
    cap_gpu_memory(None)  # no cap asked: nothing to do, GPU or not
    if not torch_cuda():
        with pytest.raises(SystemExit, match="there is no GPU here"):
            cap_gpu_memory(80.0)
