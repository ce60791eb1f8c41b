"""Parsing tool calls out of generated text: the Hermes/Qwen format and the plain [[name: text]] one."""

from __future__ import annotations

import json
import time

import pytest

from hybridflow.tools import ToolCall, find_calls, stop_strings, turn_end
from hybridflow.tools.calls import MAX_CALL_CHARS, MAX_CALLS


def test_hermes_several_calls_in_order() -> None:
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": {"query": "x", "k": 3}}</tool_call> done'
    )
    result = find_calls(text, "hermes")
    assert result.errors == []
    assert [(c.name, c.arguments) for c in result.calls] == [
        ("calc", {"expression": "1+2"}),
        ("search", {"query": "x", "k": 3}),
    ]
    assert result.calls[1].raw.startswith("<tool_call>") and result.calls[1].raw.endswith("</tool_call>")
    assert result.calls[0].text is None


def test_hermes_arguments_as_json_string_and_missing() -> None:
    text = (
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    result = find_calls(text)
    assert result.errors == []
    assert result.calls == [
        ToolCall("calc", {"expression": "2*3"}, result.calls[0].raw),
        ToolCall("now", {}, result.calls[1].raw),
    ]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"name": "calc", "arguments": {"expression": "1+2"}', "bad JSON"),
        ('{"arguments": {}}', '"name"'),
        ('["calc"]', "JSON object"),
        ('{"name": "calc", "arguments": "not json"}', "not JSON"),
        ('{"name": "calc", "arguments": [1]}', "must be an object"),
    ],
)
def test_hermes_malformed_calls_are_counted_not_raised(body: str, reason: str) -> None:
    text = f'<tool_call>{body}</tool_call> <tool_call>{{"name": "ok"}}</tool_call>'
    result = find_calls(text, "hermes")
    assert [c.name for c in result.calls] == ["ok"]
    assert len(result.errors) == 1 and reason in result.errors[0], result.errors


def test_hermes_unclosed_call() -> None:
    result = find_calls('<tool_call>{"name": "a"}', "hermes")
    assert result.calls == [] and "unclosed" in result.errors[0]
    result = find_calls('<tool_call>{"name": "a"} <tool_call>{"name": "b"}</tool_call>', "hermes")
    assert [c.name for c in result.calls] == ["b"] and "unclosed" in result.errors[0]


def test_plain_calls_and_positional_binding() -> None:
    text = "[[calc: 123*45]] then [[code: print(1)]]"
    unbound = find_calls(text, "plain")
    assert [(c.name, c.text, c.arguments) for c in unbound.calls] == [
        ("calc", "123*45", {}),
        ("code", "print(1)", {}),
    ]
    bound = find_calls(text, "plain", positional={"calc": "expression"})
    assert bound.calls[0].arguments == {"expression": "123*45"} and bound.calls[1].arguments == {}
    assert bound.calls[0].raw == "[[calc: 123*45]]"


def test_plain_malformed() -> None:
    result = find_calls("[[no colon]] [[calc: 1]] [[calc: 2", "plain")
    assert [c.text for c in result.calls] == ["1"]
    assert len(result.errors) == 2
    assert "expected [[name: text]]" in result.errors[0] and "unclosed" in result.errors[1]


def test_text_without_calls() -> None:
    for fmt in ("hermes", "plain"):
        result = find_calls("The answer is 42. [x] <b>", fmt)
        assert result.calls == [] and result.errors == [] and not result.has_calls


def test_stop_strings_and_turn_end() -> None:
    assert stop_strings("hermes") == ("</tool_call>",) and stop_strings("plain") == ("]]",)
    text = 'a <tool_call>{"name": "x"}</tool_call> tail'
    assert text[: turn_end(text, "hermes")].endswith("</tool_call>")
    assert turn_end("[[calc: 1]] more", "plain") == len("[[calc: 1]]")
    assert turn_end("no call", "hermes") is None and turn_end("[[calc: 1", "plain") is None
    with pytest.raises(ValueError, match="unknown tool-call format"):
        find_calls("x", "xml")


# --- hostile output: whatever a policy samples is answered with an error line, in linear time ---------------


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _call(arguments: str) -> str:
    return '{"name": "calc", "arguments": ' + arguments + "}"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (_call(_deep(1000)), "nested 1001 deep"),
        (_call('{"x": ' + _deep(50) + "}"), "nested 52 deep"),
        (_call(json.dumps(_deep(1000))), "nested 1000 deep"),  # arguments as a JSON string
        (_call('{"x": ' + "9" * 5000 + "}"), "an integer of 5000 digits"),
        (_call(json.dumps('{"x": -' + "9" * 5000 + "}")), "an integer of 5000 digits"),
        (_call(json.dumps({"x": "a" * MAX_CALL_CHARS})), "characters long"),
    ],
)
def test_hostile_json_is_an_error_line(body: str, reason: str) -> None:
    text = f'<tool_call>{body}</tool_call><tool_call>{{"name": "ok"}}</tool_call>'
    result = find_calls(text, "hermes")
    assert [c.name for c in result.calls] == ["ok"]
    assert len(result.errors) == 1 and reason in result.errors[0], result.errors[0][:200]
    assert len(result.errors[0]) < 400  # the error quotes the call shortened


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    args = {"code": "x = " + "[" * 100 + "]" * 100, "s": '\\"[{'}
    result = find_calls(f"<tool_call>{json.dumps({'name': 'py', 'arguments': args})}</tool_call>")
    assert result.errors == [] and result.calls[0].arguments == args


def test_many_calls_in_one_turn_stop_at_the_cap() -> None:
    for fmt, one in (("hermes", '<tool_call>{"name": "a"}</tool_call>'), ("plain", "[[a: 1]]")):
        result = find_calls(one * (MAX_CALLS + 50), fmt)
        assert len(result.calls) == MAX_CALLS and len(result.errors) == 1 and "more than" in result.errors[0]


@pytest.mark.parametrize(
    "text",
    [
        "[[" * 200_000,  # the plain parser was quadratic here
        "[[calc: 1]" * 100_000,
        "<tool_call>" * 100_000,
        "<tool_call>{" * 100_000 + "</tool_call>",
        "x" * 3_000_000,
        '<tool_call>{"name": "a", "arguments": {"s": "' + "\\\\" * 200_000 + '"}}</tool_call>',
    ],
    ids=["plain-opens", "plain-unclosed", "hermes-opens", "hermes-braces", "3MB-text", "escapes"],
)
def test_parsing_is_linear_in_the_text(text: str) -> None:
    for fmt in ("hermes", "plain"):
        start = time.perf_counter()
        result = find_calls(text, fmt)
        turn_end(text, fmt)
        assert time.perf_counter() - start < 1.0, fmt  # quadratic parsing took minutes on these
        assert len(result.calls) + len(result.errors) <= MAX_CALLS + 1


def test_text_that_was_not_utf8_parses() -> None:
    """What a byte-level tokenizer decodes from invalid UTF-8 (replacement characters) and lone surrogates
    from JSON escapes reach the tool as text, never as an exception."""
    bad = b'\xff\xfe<tool_call>{"name": "calc", "arguments": {"e": "\xc3"}}</tool_call>'
    result = find_calls(bad.decode("utf-8", errors="replace"))
    assert result.calls[0].arguments == {"e": "\ufffd"}
    lone = find_calls('<tool_call>{"name": "calc", "arguments": {"e": "\\ud800"}}</tool_call>')
    assert lone.calls[0].arguments == {"e": "\ud800"}
