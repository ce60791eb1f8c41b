"""The calculator agent written with the OpenAI Agents SDK (``pip install openai-agents``): an ``Agent``
with a ``calc`` function tool, run by ``Runner.run`` on a chat-completions model built on the episode's
client. The reward is 1 when the final output's last ``#### <integer>`` is the row's ground truth.

    hybridflow train data.task=multiply rollout.harness.module=examples/agents/agents_sdk_calculator.py \
        rollout.harness.tool_format=plain
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from agents.exceptions import MaxTurnsExceeded

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ReAct example's evaluator, beside this file


@function_tool
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression of integers."""
    from react_calculator import calc as evaluate  # the same evaluator as the ReAct example

    return evaluate(expression)


async def episode(client: Any, row: dict[str, Any]) -> float:
    """One run of the agent on the row's question."""
    agent = Agent(
        name="calculator",
        instructions=None,
        tools=[calc],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    prompt = row["raw_prompt"]
    question = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
    try:
        result = await Runner.run(agent, question, max_turns=4, run_config=RunConfig(tracing_disabled=True))
    except MaxTurnsExceeded:
        return 0.0
    found = re.findall(r"####\s*(-?\d+)", str(result.final_output))
    return float(bool(found) and found[-1] == str(row["ground_truth"]).strip())
