"""ToolSet: schemas, argument validation, failures as results, timeouts (thread and subprocess), specs."""

from __future__ import annotations

import time

import pytest
import tool_funcs

from hybridflow.tools import Tool, ToolCall, ToolSet, calculator_tool, tool_from_spec
from hybridflow.utils.errors import UserError

TEXT_PARAMS = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}
SLEEP_PARAMS = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}


def _tools() -> ToolSet:
    return ToolSet(
        [
            Tool("echo", "Echo the text.", TEXT_PARAMS, tool_funcs.echo),
            Tool("sleepy", "Sleep.", SLEEP_PARAMS, tool_funcs.sleepy),
            Tool("broken", "Raise.", TEXT_PARAMS, tool_funcs.broken),
            calculator_tool(),
        ]
    )


def test_schemas_are_openai_functions() -> None:
    schemas = _tools().schemas()
    assert [s["function"]["name"] for s in schemas] == ["echo", "sleepy", "broken", "calc"]
    assert schemas[0] == {
        "type": "function",
        "function": {"name": "echo", "description": "Echo the text.", "parameters": TEXT_PARAMS},
    }


def test_run_ok_and_plain_call_bound_to_positional_parameter() -> None:
    tools = _tools()
    result = tools.run(ToolCall("echo", {"text": "hi"}, raw=""))
    assert result.ok and result.text == "echo: hi" and result.seconds >= 0
    parsed = tools.parse("[[calc: 123*45]] [[echo: yo]]", "plain")
    assert [tools.run(c).text for c in parsed.calls] == ["5535", "echo: yo"]
    # A plain call parsed without the tool set is bound when it runs.
    assert tools.run(ToolCall("calc", {}, raw="", text="2**10")).text == "1024"


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (ToolCall("nope", {}, ""), "unknown tool 'nope'; available tools: broken, calc, echo, sleepy"),
        (ToolCall("echo", {}, ""), "missing required argument(s) text"),
        (ToolCall("echo", {"text": "a", "extra": 1}, ""), "has no argument(s) extra"),
        (ToolCall("echo", {"text": 3}, ""), "'text' of 'echo' must be of type string"),
        (ToolCall("sleepy", {"seconds": True}, ""), "must be of type number"),
    ],
)
def test_bad_calls_become_error_results(call: ToolCall, expected: str) -> None:
    result = _tools().run(call)
    assert not result.ok and expected in result.error
    assert result.text.startswith("Error: ") and expected in result.text


def test_types_integer_array_object_enum() -> None:
    params = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "xs": {"type": "array", "items": {"type": "number"}},
            "o": {"type": "object"},
            "mode": {"type": "string", "enum": ["a", "b"]},
            "flag": {"type": "boolean"},
        },
    }
    tools = ToolSet([Tool("t", "d", params, lambda **kw: "ok")])
    assert (
        tools.validate(ToolCall("t", {"n": 1, "xs": [1, 2.5], "o": {}, "mode": "a", "flag": False}, ""))
        is None
    )
    for bad in ({"n": 1.5}, {"xs": [1, "2"]}, {"o": []}, {"mode": "c"}, {"flag": 1}, {"xs": "1"}):
        assert tools.validate(ToolCall("t", bad, "")) is not None, bad


def test_raising_tool_is_an_error_result_without_traceback() -> None:
    result = _tools().run(ToolCall("broken", {"text": "this"}, ""))
    assert result.error == "RuntimeError: cannot handle this"
    assert "Traceback" not in result.text


def test_calc_refusal_is_an_error_result() -> None:
    result = _tools().run(ToolCall("calc", {"expression": "__import__('os')"}, ""))
    assert not result.ok and result.error.startswith("CalcError: unsupported syntax")


def test_hanging_thread_tool_times_out_quickly() -> None:
    start = time.monotonic()
    result = _tools().run(ToolCall("sleepy", {"seconds": 5}, ""), timeout_s=0.3)
    assert time.monotonic() - start < 2
    assert result.error == "tool 'sleepy' timed out after 0.3 s" and 0.3 <= result.seconds < 2


def test_isolated_tool_runs_in_a_subprocess_and_is_killed_on_timeout() -> None:
    tools = ToolSet(
        [
            Tool("sleepy", "Sleep.", SLEEP_PARAMS, tool_funcs.sleepy, isolated=True),
            Tool("broken", "Raise.", TEXT_PARAMS, tool_funcs.broken, isolated=True),
            Tool("echo", "Echo.", TEXT_PARAMS, tool_funcs.echo, isolated=True),
        ]
    )
    assert tools.run(ToolCall("echo", {"text": "x"}, ""), timeout_s=30).text == "echo: x"
    assert (
        tools.run(ToolCall("broken", {"text": "x"}, ""), timeout_s=30).error
        == "RuntimeError: cannot handle x"
    )
    start = time.monotonic()
    result = tools.run(ToolCall("sleepy", {"seconds": 60}, ""), timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert "timed out after 1 s (its process was killed)" in result.error


def test_isolated_tool_must_be_importable() -> None:
    with pytest.raises(UserError, match="module-level function"):
        ToolSet([Tool("lam", "d", TEXT_PARAMS, lambda text: text, isolated=True)])


def test_non_string_results_and_output_cap() -> None:
    params = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    tools = ToolSet(
        [Tool("add", "d", params, tool_funcs.add), Tool("big", "d", {"type": "object"}, lambda: "y" * 50)],
        max_output_chars=10,
    )
    assert tools.run(ToolCall("add", {"a": 2, "b": 3}, "")).text == "5"
    assert tools.run(ToolCall("big", {}, "")).text == "y" * 10 + "\n[output truncated: 40 more characters]"


def test_bad_tool_definitions_are_user_errors() -> None:
    with pytest.raises(UserError, match="unique name"):
        ToolSet([calculator_tool(), calculator_tool()])
    with pytest.raises(UserError, match="JSON schema object"):
        ToolSet([Tool("t", "d", {"type": "string"}, tool_funcs.echo)])
    with pytest.raises(UserError, match=r"\['x'\] are not in its properties"):
        ToolSet([Tool("t", "d", {"type": "object", "required": ["x"]}, tool_funcs.echo)])


def test_tool_from_spec() -> None:
    spec = {"name": "echo", "description": "Echo.", "parameters": TEXT_PARAMS, "function": "tool_funcs:echo"}
    tool = tool_from_spec(spec)
    assert tool.function is tool_funcs.echo and not tool.isolated
    assert ToolSet([tool]).run(ToolCall("echo", {"text": "a"}, "")).text == "echo: a"
    assert tool_from_spec({**spec, "isolated": True, "timeout_s": 2}).timeout_s == 2.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"function": "no_such_module_xyz:f"}, "cannot import module 'no_such_module_xyz'"),
        ({"function": "tool_funcs:missing"}, "has no 'missing'"),
        ({"function": "tool_funcs.echo"}, "must look like 'module.path:function_name'"),
        ({"function": "tool_funcs:NOT_CALLABLE"}, "is not callable"),
        ({"parameters": "text"}, "JSON schema object"),
        ({"colour": "red"}, r"unknown key\(s\) \['colour'\]"),
    ],
)
def test_tool_from_spec_errors_name_the_spec_and_the_fix(change: dict, message: str) -> None:
    spec = {"name": "echo", "description": "Echo.", "parameters": TEXT_PARAMS, "function": "tool_funcs:echo"}
    with pytest.raises(UserError, match=message) as info:
        tool_from_spec({**spec, **change})
    assert "'echo'" in str(info.value)
