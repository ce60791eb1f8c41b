"""L2: tools for multi-turn rollouts: parsing calls out of generated text, running them, built-in tools.

The agent loop (in the rollout engine) stops sampling at a tool call, parses it with ``ToolSet.parse`` (or
``find_calls``), runs it with ``ToolSet.run``, appends the result's text (never trained on) and continues.
Everything here works on plain values (strings, dicts) and imports only the standard library.

* ``find_calls(text, fmt)``, ``stop_strings(fmt)``, ``turn_end(text, fmt)``: the Hermes/Qwen
  ``<tool_call>{json}</tool_call>`` format and the plain ``[[name: text]]`` one; ``ToolCall``, ``ParseResult``.
* ``Tool``, ``ToolSet`` (``schemas()``, ``parse()``, ``validate()``, ``run(call, timeout_s)``), ``ToolResult``,
  ``tool_from_spec(spec)`` for a YAML-style ``{name, description, parameters, function: "module:fn"}``.
* Built-in tools: ``calculator_tool()`` (``calc``: bounded arithmetic) and ``code_interpreter_tool()``
  (Python in a bubblewrap sandbox of its own namespaces with rlimits, ``run_python``/``SandboxLimits``;
  ``isolation.probe()`` says whether this host can isolate; docs/tools.md has the threat model).
"""

from __future__ import annotations

from hybridflow.tools.calculator import CalcError, calc, calculator_tool, evaluate
from hybridflow.tools.calls import FORMATS, ParseResult, ToolCall, find_calls, stop_strings, turn_end
from hybridflow.tools.registry import Tool, ToolResult, ToolSet, tool_from_spec
from hybridflow.tools.sandbox import SandboxLimits, SandboxResult, code_interpreter_tool, run_python

__all__ = [
    "FORMATS",
    "CalcError",
    "ParseResult",
    "SandboxLimits",
    "SandboxResult",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolSet",
    "calc",
    "calculator_tool",
    "code_interpreter_tool",
    "evaluate",
    "find_calls",
    "run_python",
    "stop_strings",
    "tool_from_spec",
    "turn_end",
]
