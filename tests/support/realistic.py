"""Data that looks real, for the multi-rank tests: what an ordinary dataset gives a run.

- ``realistic_rows``: verl-schema rows whose chat prompts run from a few tokens to a few hundred (a system
  turn on some, an earlier exchange on others), from two data sources;
- ``build_stopping_model``: a tiny Qwen2 or Llama (GQA) briefly trained so that sampled responses end at EOS
  after different numbers of tokens (some run to the length limit); ``build_chatty_model`` one whose greedy
  answers differ from prompt to prompt;
- ``REWARD_SOURCE`` / ``TOKEN_REWARD_SOURCE``: reward files whose groups tie on one data source (every sample
  scores the same) and differ on the other; the second is a token-id reward function.
- ``preference_rows`` / ``kto_rows``: DPO pairs and KTO examples with prompts and answers of different lengths;
- ``sft_rows``: SFT rows, prompts and answers of different lengths and tool conversations (turns masked).

Every multi-rank test runs on these instead of the built-in task, whose prompts all have one length.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from hybridflow.data.tasks import make_task
from hybridflow.models import build_tiny_model_and_tokenizer

WORDS = tuple(
    [
        "the",
        "sum",
        "of",
        "seven",
        "apples",
        "and",
        "three",
        "pears",
        "is",
        "what",
        "number",
        "please",
        "answer",
        "briefly",
        "with",
        "only",
        "digits",
        "a",
        "train",
        "leaves",
        "at",
        "noon",
        "travelling",
        "north",
        "how",
        "far",
        "has",
        "it",
        "gone",
        "by",
        "evening",
        "if",
        "it",
        "never",
        "stops",
    ]
)
SYSTEM = "You are a careful assistant. Think, then reply with the answer only."
# Prompt content lengths in characters (the char tokenizer gives one token each, plus the chat template).
CONTENT_CHARS = (1, 3, 8, 20, 45, 90, 160, 260)
# Response lengths of the warm-up data, in characters before the end of the turn.
ANSWER_CHARS = (1, 2, 4, 6, 9, 13)

REWARD_SOURCE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "chat/tie":
        return 1.0  # every sample of these groups scores the same: GRPO gives them advantage 0
    return float(len(solution_str) % 3 == 0) + 0.5 * float(ground_truth in solution_str)
"""

TOKEN_REWARD_SOURCE = """
def compute_score(prompt_ids, response_ids, tokenizer):
    # Reads token ids only (no decoding): the prompt's length parity and the response's length.
    return float((len(prompt_ids) + len(response_ids)) % 2 == 0)
"""


def _text(rng: random.Random, chars: int) -> str:
    out = ""
    while len(out) < chars:
        out += rng.choice(WORDS) + " "
    return out[:chars].strip() or "?"


def realistic_rows(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows in verl's schema with chat prompts of very different lengths (one row per length first)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        chars = CONTENT_CHARS[i % len(CONTENT_CHARS)] if i < len(CONTENT_CHARS) else rng.choice(CONTENT_CHARS)
        messages = [{"role": "system", "content": SYSTEM}] if i % 3 == 2 else []
        if i % 4 == 1:  # an earlier exchange in the conversation
            messages += [{"role": "user", "content": _text(rng, 12)}, {"role": "assistant", "content": "7"}]
        messages.append({"role": "user", "content": _text(rng, chars)})
        rows.append(
            {
                # a plain-text prompt now and then (a handful of tokens, templated as one user turn)
                "prompt": messages if i % 8 != 4 else _text(rng, chars % 12 + 3),
                "data_source": "chat/tie" if i % 4 == 3 else "chat/vary",
                "reward_model": {"ground_truth": str(rng.randint(0, 9)), "style": "rule"},
                "extra_info": {"index": i, "split": "train"},
            }
        )
    rng.shuffle(rows)  # long and short prompts land in every rank's share
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    """Rows as a JSON-lines file."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _warm_up(model: torch.nn.Module, tokenizer: Any, steps: int, seed: int) -> None:
    """A few AdamW steps on chat prompts answered with short replies of different lengths then EOS."""
    rng = random.Random(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    examples = []
    for row in realistic_rows(32, seed + 1):
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(_text(rng, rng.choice(ANSWER_CHARS)), add_special_tokens=False)["input_ids"]
        examples.append((ids, [*answer, end]))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread (and unharmed by busy cores)
    for step in range(steps):
        prompt, answer = examples[step % len(examples)]
        ids = torch.tensor([prompt + answer])  # (1, T)
        labels = torch.tensor([[-100] * len(prompt) + answer])  # the loss is on the reply only
        model(input_ids=ids, labels=labels).loss.backward()
        optim.step()
        optim.zero_grad()
    torch.set_num_threads(threads)
    model.eval()


def build_stopping_model(out_dir: Path, arch: str = "qwen2", steps: int = 64, seed: int = 0) -> Path:
    """A tiny model with GQA (4 query heads, 2 KV heads) whose samples stop at EOS at different places."""
    torch.manual_seed(seed)
    model, tokenizer = build_tiny_model_and_tokenizer(
        arch=arch,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        seed=seed,
    )
    _warm_up(model, tokenizer, steps, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_chatty_model(out_dir: Path, arch: str = "qwen2", scale: float = 20.0) -> Path:
    """A tiny GQA model with large random weights: its greedy answers differ from prompt to prompt.

    (The warmed-up model above answers greedily with EOS at once.) With ``STOP_CHARS`` as stop tokens its
    greedy answers end at different places, some at the length limit.
    """
    model, tokenizer = build_tiny_model_and_tokenizer(
        arch=arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# Characters whose tokens end a greedy answer of the chatty model (rollout.stop_token_ids).
STOP_CHARS = "aeiou "


def preference_rows(n: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """DPO rows: chat prompts of different lengths, chosen and rejected answers of different lengths."""
    rng = random.Random(seed)
    out = []
    for row in realistic_rows(n, seed):
        chosen = _text(rng, rng.choice(ANSWER_CHARS))
        rejected = _text(rng, rng.choice(ANSWER_CHARS) + 3)
        out.append({"prompt": row["prompt"], "chosen": chosen, "rejected": rejected})
    return out


def kto_rows(n: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """KTO rows: chat prompts of different lengths, completions of different lengths, labels both ways."""
    rng = random.Random(seed)
    return [
        {"prompt": row["prompt"], "completion": _text(rng, rng.choice(ANSWER_CHARS)), "label": i % 3 != 0}
        for i, row in enumerate(realistic_rows(n, seed))
    ]


def sft_rows(n: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """SFT rows: chat prompts of very different lengths (a system turn on some, an earlier exchange on others,
    a plain-text one) answered in a few to a hundred characters, and every third row a conversation whose
    assistant turns call the ``calc`` tool (trained on its assistant turns only)."""
    rng = random.Random(seed)
    calls = make_task("multiply", "train", n, seed, call_fraction=1.0)
    out: list[dict[str, Any]] = []
    for i, row in enumerate(realistic_rows(n, seed)):
        if i % 3 == 2:
            out.append({"messages": calls[i]["messages"]})
        else:
            out.append({"prompt": row["prompt"], "response": _text(rng, rng.choice((2, 9, 30, 100)))})
    return out
