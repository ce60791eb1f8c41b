"""Chat datasets as people hold them, for the tests of the notebook API, the step-wise loop and the datasets.

- ``ultrachat_rows``: rows shaped like HuggingFaceH4/ultrachat_200k (``prompt``: the first user turn as a
  string, ``prompt_id``: a sha256 hex string, ``messages``: user and assistant turns alternating, starting with
  the user). First user turns of about 68 and of 444-474 characters (the char tokenizer's tokens: one per byte
  of ASCII), single- and multi-turn rows, and the dataset's own Chinese row;
- ``trl_conversational_rows``: TRL's conversational prompt-only (``prompt`` as messages) and prompt-completion
  (``prompt`` + ``completion`` as messages) rows;
- ``verl_rows``: verl's row schema (``data_source``, ``prompt`` as messages, ``ability``, ``reward_model``
  with ``style`` and ``ground_truth``, ``extra_info``);
- ``as_dataset``: the same rows as a ``datasets.Dataset`` (skips the test where ``datasets`` is missing).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import pytest

SENTENCES = (
    "How do the seasons change the migration routes of birds in northern Europe?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain the difference between a list and a tuple in Python, with an example of each.",
    "What are the main causes of inflation, and how do central banks respond to it?",
    "Summarise the plot of a novel you like in three sentences.",
    "Give me a recipe for a vegetarian lasagne that serves four people.",
    "Why is the sky blue during the day but red at sunset?",
    "Describe the water cycle for a ten-year-old.",
)
FILLER = (
    "Please be specific and give reasons.",
    "I am preparing a presentation for my class next week.",
    "Use simple words, because English is not my first language.",
    "If there are several possible answers, list the most common ones first.",
    "Include a short example if that helps.",
    "Keep the answer under two hundred words.",
)
ANSWERS = (
    "Sure. Here is a short answer.",
    "There are three main reasons, and the first is the most important one.",
    "Great question!",
    "Of course. Let me explain step by step, starting with the basics.",
)
FOLLOW_UPS = (
    "Can you say more about the second point?",
    "Thanks! And what about winter?",
    "Shorter, please.",
)
CHINESE_PROMPT = "请用三句话介绍一下长城的历史。"
CHINESE_ANSWER = "长城始建于春秋战国时期。秦朝把各段城墙连接起来。明朝时大规模重修。"


def _user_turn(rng: random.Random, chars: int) -> str:
    """A question padded with plausible filler to about ``chars`` characters (cut at a word boundary)."""
    text = rng.choice(SENTENCES)
    while len(text) < chars:
        text += " " + rng.choice(FILLER)
    return text[:chars].rsplit(" ", 1)[0] if len(text) > chars else text


def _prompt_id(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def ultrachat_rows(n: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` ultrachat_200k-shaped rows (the last one Chinese): lengths and turn counts differ row to row."""
    rng = random.Random(seed)
    rows = []
    for i in range(n - 1):
        first = _user_turn(rng, 68 if i % 3 == 0 else rng.randint(444, 474))
        messages = [{"content": first, "role": "user"}, {"content": rng.choice(ANSWERS), "role": "assistant"}]
        for _ in range(i % 3):  # rows of one, two and three exchanges
            messages.append({"content": rng.choice(FOLLOW_UPS), "role": "user"})
            messages.append({"content": rng.choice(ANSWERS), "role": "assistant"})
        rows.append({"prompt": first, "prompt_id": _prompt_id(first), "messages": messages})
    messages = [{"content": CHINESE_PROMPT, "role": "user"}, {"content": CHINESE_ANSWER, "role": "assistant"}]
    rows.append({"prompt": CHINESE_PROMPT, "prompt_id": _prompt_id(CHINESE_PROMPT), "messages": messages})
    return rows


def trl_conversational_rows(n: int = 6, seed: int = 1) -> list[dict[str, Any]]:
    """TRL's conversational rows: prompt-only on even rows, prompt-completion on odd ones (a system turn on some)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [{"role": "user", "content": _user_turn(rng, rng.choice((30, 120, 300)))}]
        if i % 4 == 1:
            prompt.insert(0, {"role": "system", "content": "You are a helpful assistant."})
        row: dict[str, Any] = {"prompt": prompt}
        if i % 2:
            row["completion"] = [{"role": "assistant", "content": rng.choice(ANSWERS)}]
        rows.append(row)
    return rows


def verl_rows(n: int = 6, seed: int = 2) -> list[dict[str, Any]]:
    """verl's row schema (gsm8k-style): chat prompts of different lengths with a ground truth each."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        question = f"Natalia sold {a} clips in April and {b} in May. How many clips did she sell altogether?"
        question += " " + " ".join(rng.sample(FILLER, k=i % 3))
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question.strip() + " Let's think step by step."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"},
            }
        )
    return rows


def as_dataset(rows: list[dict[str, Any]]) -> Any:
    """``rows`` as a ``datasets.Dataset`` (the test is skipped where the package is missing).

    Columns are the union of the rows' keys, None where a row lacks one (as in a parquet file):
    ``Dataset.from_list`` would take the first row's keys and drop the others' extra columns without a word.
    """
    datasets = pytest.importorskip("datasets")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return datasets.Dataset.from_dict({key: [row.get(key) for row in rows] for key in columns})
