"""Chat rows as people hold them: a conversation's prompt and reference answer, and which column the prompt is.

The rule (``resolve_prompt``), applied to every row of the notebook API and of ``data.train_files``:

  1. The prompt column (``data.prompt_key``, default ``prompt``) is the prompt when it holds chat messages
     (verl's schema, TRL's conversational formats), whatever else the row has.
  2. Otherwise (no prompt column, or text), when the row has ``messages`` (ultrachat, TRL's SFT format), ``messages`` is the
     conversation: system, user, assistant (and tool) turns in order. The prompt is every turn up to and
     including the last user turn, so earlier assistant turns stay between the user turns they answered;
     the last assistant turn after it, when there is one, is the row's reference answer. A text prompt in
     the same row (ultrachat's ``prompt``: a copy of the first user turn) is not used, and the dataset's
     log says so once.
  3. A row without ``messages`` whose prompt column is text keeps it (``RLDataset`` puts it through the chat
     template as one user turn unless ``data.template_text_prompts=false``).
  4. A ``completion`` column (TRL's prompt-completion format: one assistant message, or text) is the
     reference answer of a row that has none from ``messages``.

The reference answer goes to ``extra_info["answer"]`` (where verl's GSM8K rows keep their worked answer and
SFT looks for one), unless the row already has one there, and becomes ``reward_model.ground_truth`` only for
a row without a ground truth of its own: verl-shaped reward functions receive it as ``ground_truth`` and in
``extra_info``, TRL-shaped ones as the ``answer`` (and ``ground_truth``) keyword lists.

A ``messages`` value that is not a list of ``{"role", "content"}`` turns with string content and a known
role, or one with no user turn, is refused naming the row; turns are never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.data.rows import RowOrigin, row_error

MESSAGES_KEY = "messages"
COMPLETION_KEY = "completion"
ANSWER_KEY = "answer"  # the extra_info key of the reference answer
ROLES = ("system", "user", "assistant", "tool")
ANSWER_ROLES = ("assistant", "tool")  # what may follow the last user turn


@dataclass(frozen=True)
class Resolution:
    """What ``resolve_prompt`` did with one row: where the prompt came from and the reference answer."""

    source: str  # 'prompt' (the prompt column), 'messages', or 'prompt over messages' (rule 1 with both)
    answer: str | None = None
    text_and_messages: bool = False  # rule 2 ignored a text prompt in the same row


def _as_list(value: Any) -> list[Any] | None:
    """``value`` as a list when it is a sequence (parquet through pandas gives numpy arrays), else None."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    return list(value) if isinstance(value, (list, tuple)) else None


def is_chat(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of dicts (chat messages, not yet validated)."""
    turns = _as_list(value)
    return bool(turns) and all(isinstance(t, Mapping) for t in turns)


def check_turns(value: Any, origin: RowOrigin, column: str) -> list[dict[str, str]]:
    """The turns of a conversation column as ``{"role", "content"}`` dicts; DataError naming the row if bad."""
    turns = _as_list(value)
    fix = "fix the column, or drop it if the prompt is elsewhere"
    if not turns:
        got = "an empty list" if turns == [] else f"{type(value).__name__} {_short(value)}"
        raise row_error(
            origin, f"column {column!r} must be a list of {{'role', 'content'}} turns, got {got}; {fix}"
        )
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or "role" not in turn or "content" not in turn:
            raise row_error(
                origin, f"{column}[{i}] must be a {{'role', 'content'}} turn, got {_short(turn)}; {fix}"
            )
        role, content = turn["role"], turn["content"]
        if role not in ROLES:
            raise row_error(
                origin,
                f"{column}[{i}] has role {role!r}; the roles are {', '.join(ROLES)}: rename it in the data",
            )
        if not isinstance(content, str):
            raise row_error(
                origin,
                f"{column}[{i}]['content'] must be a str, got {type(content).__name__} {_short(content)}; "
                "multimodal and tool-call-only turns are not supported",
            )
        out.append({"role": role, "content": content})
    return out


def split_conversation(
    turns: list[dict[str, str]], origin: RowOrigin, column: str
) -> tuple[list[dict[str, str]], str | None]:
    """The prompt (every turn up to the last user turn) and the reference answer (the last assistant after)."""
    users = [i for i, t in enumerate(turns) if t["role"] == "user"]
    if not users:
        roles = ", ".join(t["role"] for t in turns)
        raise row_error(
            origin, f"column {column!r} has no user turn (roles: {roles}); a prompt ends with a user turn"
        )
    prompt, tail = turns[: users[-1] + 1], turns[users[-1] + 1 :]
    for i, turn in enumerate(tail, start=users[-1] + 1):
        if turn["role"] not in ANSWER_ROLES:
            raise row_error(
                origin,
                f"{column}[{i}] is a {turn['role']} turn after the last user turn; only the answer "
                f"({' and '.join(ANSWER_ROLES)} turns) may follow it: move it before the user turn",
            )
    answers = [t["content"] for t in tail if t["role"] == "assistant" and t["content"].strip()]
    return prompt, (answers[-1] if answers else None)


def completion_answer(value: Any, origin: RowOrigin) -> str | None:
    """The reference answer of TRL's ``completion`` column: text, or assistant messages (the last one)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value if value.strip() else None
    turns = check_turns(value, origin, COMPLETION_KEY)
    for i, turn in enumerate(turns):
        if turn["role"] not in ANSWER_ROLES:
            raise row_error(
                origin, f"{COMPLETION_KEY}[{i}] is a {turn['role']} turn; a completion holds assistant turns"
            )
    answers = [t["content"] for t in turns if t["role"] == "assistant" and t["content"].strip()]
    return answers[-1] if answers else None


def resolve_prompt(row: dict[str, Any], prompt_key: str, origin: RowOrigin) -> Resolution:
    """Set ``row[prompt_key]`` by the module's rule and return where it came from and the reference answer."""
    prompt = row.get(prompt_key)
    messages = prompt if prompt_key == MESSAGES_KEY else row.get(MESSAGES_KEY)
    answer, source, text_and_messages = None, "prompt", False
    if messages is not None and (prompt_key == MESSAGES_KEY or not is_chat(prompt)):
        turns = check_turns(messages, origin, MESSAGES_KEY)
        row[prompt_key], answer = split_conversation(turns, origin, MESSAGES_KEY)
        source, text_and_messages = MESSAGES_KEY, isinstance(prompt, str) and prompt_key != MESSAGES_KEY
    elif messages is not None:
        source = "prompt over messages"  # rule 1: a chat prompt column wins
    if answer is None:
        answer = completion_answer(row.get(COMPLETION_KEY), origin)
    return Resolution(source, answer, text_and_messages)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
