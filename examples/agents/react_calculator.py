"""A ReAct-style calculator agent written with the plain ``openai`` client: the model is offered a ``calc``
tool in OpenAI's format; each tool call it makes is run here and answered as a tool message, until it
answers without a call (at most ``MAX_TURNS`` turns). The reward is 1 when the final answer's last
``#### <integer>`` is the row's ground truth.

    hybridflow train data.task=multiply rollout.harness.module=examples/agents/react_calculator.py \
        rollout.harness.tool_format=plain

Against a model served alone (``hybridflow serve --model DIR``) run ``python react_calculator.py URL TOKEN``.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import sys
from typing import Any

MAX_TURNS = 4
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calc(expression: str) -> str:
    """The value of an arithmetic expression (an error's text when it is not one)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("not arithmetic")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else str(result)


async def episode(client: Any, row: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Reason, act (call calc), observe, until an answer; the reward and the number of calls."""
    prompt = row["raw_prompt"]
    messages = (
        [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    )
    calls, text = 0, ""
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            text = message.content or ""
            break
        for call in message.tool_calls:
            calls += 1
            args = json.loads(call.function.arguments or "{}")
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calc(str(args.get("expression", "")))}
            )
    found = re.findall(r"####\s*(-?\d+)", text)
    return float(bool(found) and found[-1] == str(row["ground_truth"]).strip()), {"calls": float(calls)}


if __name__ == "__main__":
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=sys.argv[1], api_key=sys.argv[2])
    row = {"raw_prompt": [{"role": "user", "content": "87*69="}], "ground_truth": "6003"}
    print(asyncio.run(episode(client, row)))
