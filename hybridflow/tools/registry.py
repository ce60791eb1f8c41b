"""Tools, a set of them by name, and running a parsed call: validated, timed out, never raising.

A ``Tool`` is a name, a description, an OpenAI-function JSON schema of its parameters and a Python function
taking keyword arguments and returning a string. ``ToolSet.run(call, timeout_s)`` turns every failure of a
call (an unknown tool, bad arguments, a raising or hanging function) into a ``ToolResult`` with ``error``
set and a text the model can read: a tool failing is part of an episode, not a bug of the trainer.

Timeouts: an ordinary tool runs in a daemon thread; a hang returns an error after ``timeout_s`` but the
thread cannot be stopped (Python has no way to kill a thread) and keeps running in the background. A tool
that may hang for good, or hold the GIL in C code, should be ``isolated=True``: it then runs in a
subprocess (its function imported there by module path) that is killed on expiry.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.tools.calls import ParseResult, ToolCall, find_calls
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_OUTPUT_CHARS = 8192  # a tool's text is appended to the context: keep it bounded
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    # bool is an int in Python but not a number in JSON.
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


@dataclass
class Tool:
    """A callable the model may use: ``function(**arguments) -> str`` described by an OpenAI JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., str]
    isolated: bool = False  # run in a subprocess that is killed on timeout (the function must be importable)
    timeout_s: float | None = None  # overrides the timeout given to ToolSet.run

    def schema(self) -> dict[str, Any]:
        """The OpenAI ``{"type": "function", "function": {...}}`` entry of this tool."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}

    def positional_parameter(self) -> str | None:
        """The parameter a plain-format call's text binds to: the first required one, else the first one."""
        required = self.parameters.get("required") or []
        if required:
            return str(required[0])
        props = self.parameters.get("properties") or {}
        return next(iter(props), None)


@dataclass(frozen=True)
class ToolResult:
    """What a call returned: the text for the model, the error (None on success) and the seconds it took."""

    text: str
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the call succeeded."""
        return self.error is None


def _error(message: str, start: float) -> ToolResult:
    return ToolResult(text=f"Error: {message}", error=message, seconds=time.monotonic() - start)


class ToolSet:
    """Tools by name: their schemas for the chat template, parsing calls for them, and running calls."""

    def __init__(self, tools: Iterable[Tool] = (), max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> None:
        self.tools: dict[str, Tool] = {}
        self.max_output_chars = max_output_chars
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        """Register ``tool``; a duplicate name or a bad schema is a UserError."""
        if tool.name in self.tools:
            raise UserError(f"two tools are named {tool.name!r}; give each tool a unique name")
        _check_schema(tool)
        if tool.isolated:
            _function_path(tool)  # fails now, not at the first call, if the subprocess could not import it
        self.tools[tool.name] = tool

    def __contains__(self, name: object) -> bool:
        return name in self.tools

    def __getitem__(self, name: str) -> Tool:
        return self.tools[name]

    def __iter__(self) -> Iterator[Tool]:
        return iter(self.tools.values())

    def __len__(self) -> int:
        return len(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI tools list (``tools=`` of ``tokenizer.apply_chat_template``)."""
        return [tool.schema() for tool in self.tools.values()]

    def parse(self, text: str, fmt: str = "hermes") -> ParseResult:
        """The calls in ``text``, plain-format ones bound to their tool's positional parameter."""
        positional = {t.name: p for t in self.tools.values() if (p := t.positional_parameter())}
        return find_calls(text, fmt, positional)

    def validate(self, call: ToolCall) -> str | None:
        """Why ``call`` cannot run (unknown tool, missing, unknown or mistyped arguments), or None."""
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            name = (
                call.name if len(call.name) <= 60 else call.name[:60] + "..."
            )  # the policy's text: shortened
            return f"unknown tool {name!r}; available tools: {known}"
        return _validate_arguments(tool, self._arguments(tool, call))

    def run(self, call: ToolCall, timeout_s: float = DEFAULT_TIMEOUT_S) -> ToolResult:
        """Run ``call``: a ToolResult always, with ``error`` set for any failure (never raises)."""
        start = time.monotonic()
        problem = self.validate(call)
        if problem is not None:
            return _error(problem, start)
        tool = self.tools[call.name]
        limit = tool.timeout_s if tool.timeout_s is not None else timeout_s
        args = self._arguments(tool, call)
        if tool.isolated:
            value, problem = _run_isolated(tool, args, limit)
        else:
            value, problem = _run_in_thread(tool, args, limit)
        if problem is not None:
            return _error(problem, start)
        return ToolResult(text=self._capped(value), seconds=time.monotonic() - start)

    def _arguments(self, tool: Tool, call: ToolCall) -> dict[str, Any]:
        """The call's keyword arguments, a plain call's text bound to the tool's positional parameter."""
        if call.arguments or call.text is None:
            return call.arguments
        param = tool.positional_parameter()
        return {param: call.text} if param else {}

    def _capped(self, value: Any) -> str:
        text = value if isinstance(value, str) else "" if value is None else _to_text(value)
        if len(text) > self.max_output_chars:
            cut = len(text) - self.max_output_chars
            text = text[: self.max_output_chars] + f"\n[output truncated: {cut} more characters]"
        return text


def _to_text(value: Any) -> str:
    """A non-string return value as text (JSON where it can be, so the model sees a familiar form)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _check_schema(tool: Tool) -> None:
    """The tool's parameters must be an object schema (what every chat template expects)."""
    params = tool.parameters
    if not isinstance(params, dict) or params.get("type") != "object":
        raise UserError(
            f"tool {tool.name!r}: parameters must be a JSON schema object like "
            '{"type": "object", "properties": {...}, "required": [...]}'
        )
    props = params.get("properties", {})
    missing = [r for r in params.get("required", []) if r not in props]
    if not isinstance(props, dict) or missing:
        raise UserError(f"tool {tool.name!r}: required parameters {missing} are not in its properties")
    if not callable(tool.function):
        raise UserError(f"tool {tool.name!r}: function {tool.function!r} is not callable")


def _type_ok(value: Any, expected: str | list[str]) -> bool:
    types = [expected] if isinstance(expected, str) else expected
    return any(_JSON_TYPES.get(t, lambda _v: True)(value) for t in types)


def _validate_arguments(tool: Tool, args: Mapping[str, Any]) -> str | None:
    """Check ``args`` against the tool's schema: required keys, unknown keys, JSON types and enums."""
    params = tool.parameters
    props: dict[str, Any] = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        return f"tool {tool.name!r} is missing required argument(s) {', '.join(missing)}"
    if params.get("additionalProperties") is False:
        unknown = [k for k in args if k not in props]
        if unknown:
            return f"tool {tool.name!r} has no argument(s) {', '.join(unknown)}; it takes {', '.join(props)}"
    for key, value in args.items():
        spec = props.get(key, {})
        if "type" in spec and not _type_ok(value, spec["type"]):
            return f"argument {key!r} of {tool.name!r} must be of type {spec['type']}, got {value!r:.60}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} of {tool.name!r} must be one of {spec['enum']}, got {value!r:.60}"
        items = spec.get("items", {})
        if isinstance(value, list) and "type" in items and not all(_type_ok(v, items["type"]) for v in value):
            return f"items of argument {key!r} of {tool.name!r} must be of type {items['type']}"
    return None


def _describe(exc: BaseException) -> str:
    """An exception as ``Type: message`` (no traceback: it would only confuse the model)."""
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


_hung_threads = 0  # tool threads still running past their timeout (they cannot be killed)


def _run_in_thread(tool: Tool, args: dict[str, Any], timeout_s: float) -> tuple[Any, str | None]:
    """Call the tool in a daemon thread and wait at most ``timeout_s``: (value, None) or (None, error)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = tool.function(**args)
        except BaseException as exc:  # a tool's SystemExit or KeyboardInterrupt must not end the trainer
            outcome["error"] = _describe(exc)

    thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        global _hung_threads
        _hung_threads += 1
        logger.warning(
            "tool %r still running after %.1f s; its thread is left behind (%d so far). Mark the tool "
            "isolated=True to run it in a subprocess that is killed on timeout",
            tool.name, timeout_s, _hung_threads,
        )  # fmt: skip
        return None, f"tool {tool.name!r} timed out after {timeout_s:g} s"
    if "error" in outcome:
        return None, outcome["error"]
    return outcome.get("value"), None


def _function_path(tool: Tool) -> str:
    """``module:qualname`` of an isolated tool's function, checked to import back to the same object."""
    fn = tool.function
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    found: Any = None
    if module and module != "__main__" and "<" not in qualname:
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
    if found is not fn:
        raise UserError(
            f"isolated tool {tool.name!r}: its function {qualname or fn!r} must be a module-level function "
            "importable by 'module.path:function_name' (not a lambda, closure or __main__ function), since "
            "it runs in a subprocess; move it into a module or set isolated=False"
        )
    return f"{module}:{qualname}"


# The subprocess of an isolated tool: reads {path, function, arguments} as JSON on stdin, writes
# {"value"} or {"error"} as the last line of stdout (the tool's own prints come before it).
_ISOLATED_RUNNER = r"""
import importlib, json, sys
job = json.loads(sys.stdin.read())
sys.path[:0] = [p for p in job["path"] if p not in sys.path]
module, _, qualname = job["function"].partition(":")
try:
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    out = {"value": fn(**job["arguments"])}
except BaseException as exc:
    out = {"error": f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__}
sys.stdout.write("\n" + json.dumps(out, default=str) + "\n")
"""


def _run_isolated(tool: Tool, args: dict[str, Any], timeout_s: float) -> tuple[Any, str | None]:
    """Call the tool in a fresh Python subprocess, killed with its process group on timeout."""
    job = json.dumps({"path": sys.path, "function": _function_path(tool), "arguments": args}, default=str)
    proc = subprocess.Popen(
        [sys.executable, "-c", _ISOLATED_RUNNER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, text=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(job, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return None, f"tool {tool.name!r} timed out after {timeout_s:g} s (its process was killed)"
    lines = stdout.rstrip("\n").rsplit("\n", 1)
    try:
        out = json.loads(lines[-1])
    except (json.JSONDecodeError, IndexError):
        tail = stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return None, f"tool {tool.name!r} process died: {tail[0][:200]}"
    if "error" in out:
        return None, out["error"]
    return out.get("value"), None


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (the tool and anything it started) and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def tool_from_spec(spec: Mapping[str, Any]) -> Tool:
    """A Tool from a YAML-style dict ``{name, description, parameters, function: "module.path:fn"}``."""
    if not isinstance(spec, Mapping):
        raise UserError(
            f"a tool spec must be a mapping with name, description, parameters and function; got {spec!r}"
        )
    missing = [k for k in ("name", "description", "parameters", "function") if k not in spec]
    unknown = sorted(set(spec) - {"name", "description", "parameters", "function", "isolated", "timeout_s"})
    label = f"tool spec {spec.get('name', '?')!r}"
    if missing or unknown:
        raise UserError(
            f"{label}: missing key(s) {missing} / unknown key(s) {unknown}; a tool spec has name, description, "
            "parameters (a JSON schema object), function ('module.path:function_name'), optional isolated "
            "and timeout_s"
        )
    path = str(spec["function"])
    module, sep, fn_name = path.partition(":")
    if not sep or not module or not fn_name:
        raise UserError(f"{label}: function {path!r} must look like 'module.path:function_name'")
    try:
        found: Any = importlib.import_module(module)
        for part in fn_name.split("."):
            found = getattr(found, part)
    except ImportError as exc:
        raise UserError(
            f"{label}: cannot import module {module!r} ({exc}); make it importable (install it, or add its "
            "directory to PYTHONPATH) or fix the 'function' path"
        ) from exc
    except AttributeError as exc:
        raise UserError(f"{label}: module {module!r} has no {fn_name!r}; fix the 'function' path") from exc
    tool = Tool(
        name=str(spec["name"]),
        description=str(spec["description"]),
        parameters=dict(spec["parameters"])
        if isinstance(spec["parameters"], Mapping)
        else spec["parameters"],
        function=found,
        isolated=bool(spec.get("isolated", False)),
        timeout_s=float(spec["timeout_s"]) if spec.get("timeout_s") is not None else None,
    )
    _check_schema(tool)
    return tool
