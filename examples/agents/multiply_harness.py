"""The built-in ``multiply`` task (``87*69=`` -> ``#### 6003``) played by a harness of your own over the
run's OpenAI-compatible endpoint, as the built-in tool loop plays it: the model answers, a ``[[calc: a*b]]`` in
its answer is run here and sent back as a tool message, up to three assistant turns; the reward is 1 when
the last ``#### <integer>`` equals the product.

    hybridflow train data.task=multiply rollout.harness.module=examples/agents/multiply_harness.py

(``hybridflow.demos.tool_use.run_tool_demo(harness=...)`` runs the tool demo's warm-up and GRPO this way.)
"""

from __future__ import annotations

import re
from typing import Any

CALL = re.compile(r"\[\[calc:\s*(\d+)\s*\*\s*(\d+)\s*\]\]")
ANSWER = re.compile(r"####\s*(-?\d+)")


def first_user_message(row: dict[str, Any]) -> list[dict[str, str]]:
    """The row's prompt as chat messages (the dataset's ``raw_prompt``)."""
    prompt = row["raw_prompt"]
    return (
        [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    )


async def episode(client: Any, row: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """One episode: up to three assistant turns, the calculator in between; reward and tool calls."""
    messages = first_user_message(row)
    calls, answers = 0, []
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        answers.append(text)
        messages.append({"role": "assistant", "content": text})
        call = CALL.search(text)
        if call is None or reply.choices[0].finish_reason == "length":
            break
        calls += 1
        messages.append({"role": "tool", "content": str(int(call.group(1)) * int(call.group(2)))})
    found = ANSWER.findall("".join(answers))
    reward = float(bool(found) and found[-1] == str(row["ground_truth"]).strip())
    return reward, {"tool_calls": float(calls)}
