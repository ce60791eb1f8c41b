"""Tool calls parsed out of the text a model generated, in the Hermes/Qwen format or a plain one.

* ``hermes``: ``<tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>``, the format of
  Qwen2.5/Qwen3 and Hermes chat templates. ``arguments`` may also be a JSON string holding an object (some
  models emit it so); a missing ``arguments`` is ``{}``. Several calls in one turn are returned in order.
* ``plain``: ``[[calc: 123*45]]``, for tiny character-level models that cannot learn JSON. The text after the
  colon is the tool's single string parameter; it is kept in ``ToolCall.text`` and bound to the parameter
  by ``ToolSet`` (or here, when ``find_calls`` is given the parameter names).

Malformed calls (bad JSON, no name, an unclosed tag) never raise: they come back as ``ParseResult.errors``,
one human-readable line each, so that the agent loop can count them and show the model what went wrong.
Whatever a policy samples is hostile input: parsing takes time linear in the text's length, a call's JSON may
nest at most ``MAX_DEPTH`` deep and hold integers of at most ``MAX_INT_DIGITS`` digits, a call's text is at
most ``MAX_CALL_CHARS`` long and a turn yields at most ``MAX_CALLS`` calls; past any of these the call is an
error line, never an exception (``RecursionError`` and ``int``'s 4,300-digit ``ValueError`` are what
unbounded JSON would raise).
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
_PLAIN_OPEN, _PLAIN_CLOSE = "[[", "]]"
_PLAIN_HEAD = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*:(.*)\Z", re.DOTALL)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # one alternative per character: linear
_BRACKETS = re.compile(r"[\[\]{}]")
_MAX_SHOWN = 80  # characters of a malformed call quoted in its error line
MAX_DEPTH = 32  # JSON nesting of a call
MAX_INT_DIGITS = 1000  # digits of a JSON integer in a call
MAX_CALL_CHARS = 256 * 1024  # characters of one call
MAX_CALLS = 64  # calls parsed out of one turn


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
        start = text.find(_PLAIN_OPEN)
        end = text.find(_PLAIN_CLOSE, start + len(_PLAIN_OPEN)) if start >= 0 else -1
        return end + len(_PLAIN_CLOSE) if end >= 0 else None
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
    """Calls of the ``<tool_call>{json}</tool_call>`` format (one pass: each close tag is searched for once)."""
    result = ParseResult()
    pos, end = 0, -1
    while (start := text.find(_HERMES_OPEN, pos)) >= 0:
        if _full(result, text[start:]):
            break
        body_at = start + len(_HERMES_OPEN)
        if end < body_at:
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
        call, error = _parse_hermes_body(text[body_at:end], text[start : end + len(_HERMES_CLOSE)])
        if call is not None:
            result.calls.append(call)
        else:
            result.errors.append(error)
        pos = end + len(_HERMES_CLOSE)
    return result


def _full(result: ParseResult, rest: str) -> bool:
    """Whether the turn already gave ``MAX_CALLS`` calls (then one error line stands for ``rest``)."""
    if len(result.calls) + len(result.errors) < MAX_CALLS:
        return False
    result.errors.append(
        f"more than {MAX_CALLS} tool calls in one turn; the rest are ignored: {_shown(rest)}"
    )
    return True


def _load_json(body: str) -> tuple[Any, str]:
    """``json.loads`` within the bounds of the module doc: (value, '') or (None, why not)."""
    if len(body) > MAX_CALL_CHARS:
        return None, f"the call is {len(body)} characters long (at most {MAX_CALL_CHARS})"
    depth = deepest = 0
    for match in _BRACKETS.finditer(_JSON_STRING.sub('""', body)):  # brackets outside strings
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        return None, f"JSON nested {deepest} deep (at most {MAX_DEPTH})"
    try:
        return json.loads(body, parse_int=_bounded_int), ""
    except json.JSONDecodeError as exc:
        return None, f"bad JSON ({exc.msg} at char {exc.pos})"
    except (ValueError, RecursionError) as exc:  # _bounded_int, or what the scan above let through
        return None, f"bad JSON ({str(exc)[:80]})"


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def _parse_hermes_body(body: str, raw: str) -> tuple[ToolCall | None, str]:
    """One Hermes call's JSON body as a ToolCall, or None and the reason it is malformed."""
    obj, problem = _load_json(body)
    if problem:
        return None, f"{problem} in tool call: {_shown(raw)}"
    if not isinstance(obj, dict):
        return None, f"a tool call must be a JSON object, got {type(obj).__name__}: {_shown(raw)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f'tool call without a "name" string: {_shown(raw)}'
    # "parameters" is what some templates (Llama 3.1) call the arguments.
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args, problem = _load_json(args) if args.strip() else ({}, "")
        if problem:
            return None, f'"arguments" of {_shown(name)} is a string but not JSON ({problem}): {_shown(raw)}'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return (
            None,
            f'"arguments" of {_shown(name)} must be an object, got {type(args).__name__}: {_shown(raw)}',
        )
    return ToolCall(name=name.strip(), arguments=args, raw=raw), ""


def _find_plain(text: str, positional: Mapping[str, str]) -> ParseResult:
    """Calls of the ``[[name: text]]`` format: each ``[[`` up to the first ``]]`` after it (one pass)."""
    result = ParseResult()
    pos = 0
    while (start := text.find(_PLAIN_OPEN, pos)) >= 0:
        end = text.find(_PLAIN_CLOSE, start + len(_PLAIN_OPEN))
        if end < 0:
            result.errors.append(f"unclosed {_PLAIN_OPEN} (no {_PLAIN_CLOSE}): {_shown(text[start:])}")
            break
        if _full(result, text[start:]):
            break
        pos = end + len(_PLAIN_CLOSE)
        raw, inner = text[start:pos], text[start + len(_PLAIN_OPEN) : end]
        head = _PLAIN_HEAD.match(inner) if len(raw) <= MAX_CALL_CHARS else None
        if head is None:
            why = (
                "expected [[name: text]]"
                if len(raw) <= MAX_CALL_CHARS
                else f"a call over {MAX_CALL_CHARS} characters"
            )
            result.errors.append(f"{why}, got {_shown(raw)}")
            continue
        name, arg = head.group(1), head.group(2).strip()
        param = positional.get(name)
        args = {param: arg} if param else {}
        result.calls.append(ToolCall(name=name, arguments=args, raw=raw, text=arg))
    return result
