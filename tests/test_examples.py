"""The example configs under examples/configs: each loads and validates, each says how to run it,
and the LoRA one plans at the figure its comment states."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


def test_there_is_one_config_per_documented_scenario() -> None:
    names = {p.stem for p in CONFIGS}
    assert names == {"grpo_gsm8k", "ppo_critic", "dpo", "lora_24gb", "moe", "multi_turn_tools", "vlm"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_each_example_config_validates(path: Path) -> None:
    cfg = load_config(str(path))
    run = re.search(r"hybridflow(?:\.cli\.main)? (?:train|dpo|plan) examples/configs/\S+", path.read_text())
    assert run is not None, f"{path.name} says how to run it"
    if path.stem == "dpo":
        assert cfg.preference.beta > 0
    if path.stem == "multi_turn_tools":
        assert cfg.rollout.multi_turn.enable and "code_interpreter" in cfg.rollout.multi_turn.tools


def test_the_lora_example_plans_at_its_stated_peak() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli.main", "plan", str(ROOT / "examples/configs/lora_24gb.yaml"),
         "--model-shape", "qwen2.5-7b", "--gpus", "1", "--gpu-memory-gb", "24"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "| update_actor | 23.26 |" in out.stdout, out.stdout + out.stderr
    assert "23.3 GB" in (ROOT / "examples/configs/lora_24gb.yaml").read_text()
