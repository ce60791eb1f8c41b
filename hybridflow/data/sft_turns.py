"""Multi-turn SFT rows: a ``messages`` conversation (user, assistant turns, tool turns) as token ids and a loss
mask that is 1 on exactly the assistant turns' tokens.

The conversation is rendered through the chat template turn by turn. Each assistant turn is the text between
the rendering of the turns before it with the generation prompt (its header, not trained on) and the
rendering that includes it (its content and its end-of-turn token, trained on); what the template puts after
the end token (a newline) belongs to the next, untrained stretch. Everything that is not an assistant turn
(the prompt, tool results, the next assistant header) has mask 0. Each stretch is tokenised on its own, as
the rollout does (the agent loop appends a tool turn's tokens after the end token the policy sampled), so the
masks line up with the tokens exactly and a demonstration is tokenised as a rollout of it would be.

A row is trained this way when its ``messages`` hold a tool turn (``is_conversation``). The prompt is every
turn before the first assistant turn; the response is everything after it up to the end of the last
assistant turn. Rows are checked first (``check_conversation``): a clear error names the row, the
turn and the fix for a tool turn with no call before it, an empty assistant turn, a conversation with no
assistant turn or one ending in another role.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from hybridflow.data.conversations import MESSAGES_KEY, check_turns
from hybridflow.data.rows import RowOrigin, is_missing, lookup, row_error

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# What marks an assistant turn as calling a tool: a Hermes call, a plain ``[[name: text]]`` call, or an
# OpenAI-style ``tool_calls`` field next to the content.
_CALL = re.compile(r"<tool_call>|\[\[\s*[A-Za-z_][\w.\-]*\s*:")


def is_conversation(row: Any, response_key: str = "response") -> bool:
    """Whether an SFT row trains on its ``messages`` turns: they hold a tool turn and an assistant turn, and
    the row has no ``response_key`` column. (A conversation without tool turns keeps the rule of
    ``data.conversations``: its prompt runs to the last user turn and its last answer is trained on.)"""
    if not isinstance(row, dict) or not is_missing(lookup(row, response_key)):
        return False
    messages = row.get(MESSAGES_KEY)
    if hasattr(messages, "tolist"):  # parquet through pandas gives numpy arrays
        messages = messages.tolist()
    if not isinstance(messages, (list, tuple)):
        return False
    roles = {m.get("role") for m in messages if isinstance(m, dict)}
    return "tool" in roles and "assistant" in roles


def calls_a_tool(turn: dict[str, Any]) -> bool:
    """Whether an assistant turn makes a tool call (in its content, or a ``tool_calls`` field)."""
    return bool(turn.get("tool_calls")) or _CALL.search(turn.get("content") or "") is not None


def check_conversation(value: Any, origin: RowOrigin) -> list[dict[str, str]]:
    """The turns of a multi-turn SFT row, validated (DataError naming the row, the turn and the fix)."""
    raw = value.tolist() if hasattr(value, "tolist") else value
    turns = check_turns(raw, origin, MESSAGES_KEY)
    where = f"{MESSAGES_KEY}[%d]"
    for i, turn in enumerate(turns):
        role = turn["role"]
        if role == "system" and i > 0:
            raise row_error(
                origin, f"{where % i} is a system turn after the first turn; move it to the start"
            )
        if role == "assistant" and not turn["content"].strip():
            raise row_error(
                origin,
                f"{where % i} is an empty assistant turn: there is nothing to train on; write its content "
                "or drop the turn",
            )
        if role == "tool":
            before = turns[i - 1] if i else None
            called = before is not None and (
                before["role"] == "tool" or (before["role"] == "assistant" and calls_a_tool(raw[i - 1]))
            )
            if not called:
                what = f"a {before['role']} turn" if before else "nothing"
                raise row_error(
                    origin,
                    f"{where % i} is a tool turn without a preceding call ({what} comes before it): put the "
                    "assistant turn that calls the tool (<tool_call>{...}</tool_call> or [[name: argument]]) "
                    "right before its result",
                )
    firsts = [t["role"] for t in turns if t["role"] != "system"]
    if not firsts or firsts[0] != "user":
        raise row_error(origin, f"{MESSAGES_KEY} must start with a user turn (after an optional system turn)")
    if turns[-1]["role"] != "assistant":
        raise row_error(
            origin,
            f"{MESSAGES_KEY} ends with a {turns[-1]['role']} turn; a conversation to train on ends with the "
            "assistant turn that answers: drop the trailing turns or add the answer",
        )
    return turns


def _render(tokenizer: PreTrainedTokenizerBase, turns: list[dict[str, str]], open_next: bool) -> str:
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=open_next)


def _end_of_turn(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """``text`` without the whitespace a template puts after the end-of-turn token (never sampled)."""
    stripped = text.rstrip()
    if stripped != text and any(stripped.endswith(t) for t in tokenizer.all_special_tokens):
        return stripped
    return text


def conversation_stretches(
    tokenizer: PreTrainedTokenizerBase, turns: list[dict[str, str]], origin: RowOrigin
) -> tuple[str, list[tuple[str, int]]]:
    """The prompt text and the response as (text, trained) stretches, rendered turn by turn."""
    first = next(i for i, t in enumerate(turns) if t["role"] == "assistant")
    prompt = done = _render(tokenizer, turns[:first], True)
    stretches: list[tuple[str, int]] = []
    for j in range(first, len(turns)):
        if turns[j]["role"] != "assistant":
            continue
        opened = _render(tokenizer, turns[:j], True)  # up to this turn's header
        closed = _end_of_turn(tokenizer, _render(tokenizer, turns[: j + 1], False))
        if not opened.startswith(done) or not closed.startswith(opened):
            raise row_error(
                origin,
                f"the chat template renders the turns before {MESSAGES_KEY}[{j}] differently once it follows "
                "(e.g. it drops earlier reasoning), so its tokens cannot be masked turn by turn; set "
                "model.custom_chat_template to a template whose renderings extend each other",
            )
        if len(opened) > len(done):
            stretches.append((opened[len(done) :], 0))  # tool results and the next assistant header
        stretches.append((closed[len(opened) :], 1))  # the assistant turn and its end-of-turn token
        done = closed
    return prompt, stretches


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, turns: list[dict[str, str]], origin: RowOrigin | None = None
) -> tuple[list[int], list[int], list[int]]:
    """Prompt ids, response ids and the response's loss mask (1 on assistant tokens) of a checked conversation."""
    origin = origin or RowOrigin("conversation", 0)
    prompt, stretches = conversation_stretches(tokenizer, turns, origin)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    pieces = tokenizer([text for text, _ in stretches], add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    mask: list[int] = []
    for piece, (_, trained) in zip(pieces, stretches):
        ids += piece
        mask += [trained] * len(piece)
    return list(prompt_ids), ids, mask
