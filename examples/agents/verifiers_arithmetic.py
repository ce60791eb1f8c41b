"""A ``verifiers`` environment (verifiers 0.4's ``verifiers.v1`` classes): arithmetic questions answered in
two turns, scored by the task's rubric.

- ``ArithmeticTask``'s rubric: ``correct`` (1 when the final reply's last ``#### <number>`` is the answer) and
  ``formatted`` (weight 0.2: the final reply ends in ``#### <number>``); the reward is their weighted sum.
  ``reply_chars`` is a metric (the final reply's length).
- ``CheckHarness`` plays an episode in-process with the ``openai`` client against verifiers' interception
  server: it asks the question, then asks the model to check its answer (two model calls, the second one
  continuing the first).
- ``ArithmeticTaskset`` holds a few questions of its own, so that verifiers can also evaluate it alone; under
  hybridflow the rows come from the dataset (``data.task=arithmetic``), ``ground_truth`` as ``answer``.

    hybridflow train data.task=arithmetic rollout.harness.verifiers_env=examples/agents/verifiers_arithmetic.py
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import verifiers.v1 as vf

CHECK = "Sure? Reply #### <number>."
MAX_TOKENS = 24  # an answer is short: each reply may take this many tokens


def final_number(text: str) -> str | None:
    """The last ``#### <number>`` of ``text`` (None: there is none)."""
    found = re.findall(r"####\s*(-?\d+)", text)
    return found[-1] if found else None


class ArithmeticData(vf.TaskData):
    answer: str = ""


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward
    async def correct(self, task: ArithmeticData, trace: vf.Trace) -> float:
        return float(final_number(trace.last_reply) == task.answer.strip())

    @vf.reward(weight=0.2)
    async def formatted(self, task: ArithmeticData, trace: vf.Trace) -> float:
        return float(re.search(r"####\s*-?\d+\s*$", trace.last_reply) is not None)

    @vf.metric
    async def reply_chars(self, task: ArithmeticData, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ArithmeticTaskset(vf.Taskset[ArithmeticTask]):
    def load(self) -> Iterator[ArithmeticTask]:
        for a, b in [(12, 30), (7, 8), (45, 19), (3, 96)]:
            data = ArithmeticData(prompt=f"What is {a} + {b}? Answer as #### <number>.", answer=str(a + b))
            yield ArithmeticTask(data, self.config.task)


class CheckHarness(vf.Harness[vf.HarnessConfig]):
    """Ask, then ask for a check: every model call goes to the interception server at ``endpoint``."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False  # no program and no tools: the loop runs here
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        if isinstance(prompt, str):
            messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        else:
            messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt or []]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for follow_up in (None, CHECK):
                if follow_up is not None:
                    messages.append({"role": "user", "content": follow_up})
                reply = await client.chat.completions.create(
                    model=ctx.model, messages=messages, max_tokens=MAX_TOKENS
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ArithmeticTaskset", "CheckHarness"]
