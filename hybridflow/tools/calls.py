"""Tool calls parsed out of the text a model generated, in the Hermes/Qwen format or a plain one.

* ``hermes``: ``<tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>``, the format of
  Qwen2.5/Qwen3 and Hermes chat templates. ``arguments`` may also be a JSON string holding an object (some
  models emit it so); a missing ``arguments`` is ``{}``. Several calls in one turn are returned in order.
* ``plain``: ``[[calc: 123*45]]``, for tiny character-level models that cannot learn JSON. The text after the
  colon is the tool's single string parameter; it is kept in ``ToolCall.text`` and bound to the parameter
  by ``ToolSet`` (or here, when ``find_calls`` is given the parameter names).

Malformed calls (bad JSON, no name, an unclosed tag) never raise: they come back as ``ParseResult.errors``,
one human-readable line each, so that the agent loop can count them and show the model what went wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "plain")
# Stop strings per format: generation stopped on one of these has just closed a call. Stopping there gives
# one call per turn; stopping at the end-of-turn token instead lets a model make several calls in a turn.
STOP_STRINGS: dict[str, tuple[str, ...]] = {"hermes": ("</tool_call>",), "plain": ("]]",)}

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PLAIN_CALL = re.compile(r"\[\[(.*?)\]\]", re.DOTALL)
_PLAIN_HEAD = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*:(.*)\Z", re.DOTALL)
_MAX_SHOWN = 80  # characters of a malformed call quoted in its error line


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name, its keyword arguments and the exact text it was parsed from.

    ``text`` is the positional argument of a plain-format call (None for Hermes calls); ``ToolSet`` binds it
    to the tool's first required parameter when ``arguments`` is empty.
    """

    name: str
    arguments: dict[str, Any]
    raw: str
    text: str | None = None


@dataclass
class ParseResult:
    """The calls found in a turn, in order, and one error line per malformed call."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        """Whether the turn asked for at least one tool (well-formed or not)."""
        return bool(self.calls or self.errors)


def _shown(raw: str) -> str:
    """A malformed call quoted for an error line, shortened."""
    return repr(raw if len(raw) <= _MAX_SHOWN else raw[:_MAX_SHOWN] + "...")


def stop_strings(fmt: str) -> tuple[str, ...]:
    """The strings that end a tool call of format ``fmt`` (pass them as the rollout's stop strings)."""
    _check_format(fmt)
    return STOP_STRINGS[fmt]


def turn_end(text: str, fmt: str) -> int | None:
    """Offset just past the first complete call's stop string in ``text`` (where to cut the turn), or None."""
    _check_format(fmt)
    if fmt == "plain":
        match = _PLAIN_CALL.search(text)
        return match.end() if match else None
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return None
    end = text.find(_HERMES_CLOSE, start)
    return end + len(_HERMES_CLOSE) if end >= 0 else None


def find_calls(text: str, fmt: str = "hermes", positional: Mapping[str, str] | None = None) -> ParseResult:
    """Every tool call in ``text`` (format ``"hermes"`` or ``"plain"``), in order, with the malformed ones.

    ``positional`` maps a tool name to the parameter a plain call's text binds to; without it (or for a name
    it lacks) the text stays in ``ToolCall.text`` with empty ``arguments``.
    """
    _check_format(fmt)
    if fmt == "hermes":
        return _find_hermes(text)
    return _find_plain(text, positional or {})


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        # A programming error of the caller (the config layer validates user-given formats).
        raise ValueError(f"unknown tool-call format {fmt!r}; use one of {', '.join(FORMATS)}")


def _find_hermes(text: str) -> ParseResult:
    """Calls of the ``<tool_call>{json}</tool_call>`` format."""
    result = ParseResult()
    pos = 0
    while (start := text.find(_HERMES_OPEN, pos)) >= 0:
        body_at = start + len(_HERMES_OPEN)
        end = text.find(_HERMES_CLOSE, body_at)
        if end < 0:
            result.errors.append(f"unclosed {_HERMES_OPEN} (no {_HERMES_CLOSE}): {_shown(text[start:])}")
            break
        # A second opening tag before the close means the first call was never closed.
        reopen = text.find(_HERMES_OPEN, body_at, end)
        if reopen >= 0:
            result.errors.append(f"unclosed {_HERMES_OPEN} before another one: {_shown(text[start:reopen])}")
            pos = reopen
            continue
        raw = text[start : end + len(_HERMES_CLOSE)]
        call, error = _parse_hermes_body(text[body_at:end], raw)
        if call is not None:
            result.calls.append(call)
        else:
            result.errors.append(error)
        pos = end + len(_HERMES_CLOSE)
    return result


def _parse_hermes_body(body: str, raw: str) -> tuple[ToolCall | None, str]:
    """One Hermes call's JSON body as a ToolCall, or None and the reason it is malformed."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"bad JSON in tool call ({exc.msg} at char {exc.pos}): {_shown(raw)}"
    if not isinstance(obj, dict):
        return None, f"a tool call must be a JSON object, got {type(obj).__name__}: {_shown(raw)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f'tool call without a "name" string: {_shown(raw)}'
    # "parameters" is what some templates (Llama 3.1) call the arguments.
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return None, f'"arguments" of {name!r} is a string but not JSON ({exc.msg}): {_shown(raw)}'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, f'"arguments" of {name!r} must be an object, got {type(args).__name__}: {_shown(raw)}'
    return ToolCall(name=name.strip(), arguments=args, raw=raw), ""


def _find_plain(text: str, positional: Mapping[str, str]) -> ParseResult:
    """Calls of the ``[[name: text]]`` format."""
    result = ParseResult()
    pos = 0
    for match in _PLAIN_CALL.finditer(text):
        _unclosed_before(text, pos, match.start(), result)
        pos = match.end()
        head = _PLAIN_HEAD.match(match.group(1))
        if head is None:
            result.errors.append(f"expected [[name: text]], got {_shown(match.group(0))}")
            continue
        name, arg = head.group(1), head.group(2).strip()
        param = positional.get(name)
        args = {param: arg} if param else {}
        result.calls.append(ToolCall(name=name, arguments=args, raw=match.group(0), text=arg))
    _unclosed_before(text, pos, len(text), result)
    return result


def _unclosed_before(text: str, start: int, end: int, result: ParseResult) -> None:
    """Record a ``[[`` between complete calls that is never closed."""
    at = text.find("[[", start, end)
    if at >= 0:
        result.errors.append(f"unclosed [[ (no ]]): {_shown(text[at:end])}")
