"""The examples' agents (examples/agents) on a model that has learnt to call ``calc``: the ReAct agent on the
plain ``openai`` client and the OpenAI Agents SDK agent both get tool calls back in OpenAI's format, run the
tool, and score; each episode trains as one row holding its three sampled turns."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import LESSON, run_episodes

from hybridflow.engine import SamplingParams
from hybridflow.serve.harness import HarnessRunner

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"


@pytest.mark.parametrize("name", ["react_calculator", "agents_sdk_calculator"])
def test_example_agents_call_the_tool_and_score(caller, name: str) -> None:
    if name == "agents_sdk_calculator":
        pytest.importorskip("agents")
    sys.path.insert(0, str(EXAMPLES))
    try:
        module = __import__(name)
    finally:
        sys.path.remove(str(EXAMPLES))
    caller.endpoint.fixed = SamplingParams(temperature=0.0, do_sample=False, eos_token_ids=caller.eos)
    try:
        row = {"raw_prompt": [LESSON[0]], "ground_truth": "42"}
        (result,) = run_episodes(caller, HarnessRunner(module.episode, 2, 60.0, "zero"), [row])
    finally:
        caller.endpoint.fixed = None
    assert result.failure is None and result.reward == 1.0
    (seq,) = result.sequences
    assert (
        result.requests == 3
        and sum(seq.mask) == len("[[calc: 2*3]]") + len("[[calc: 6*7]]") + len("#### 42") + 3
    )
