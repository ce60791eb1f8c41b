"""OpenAI's request and response formats for ``/v1/chat/completions`` and ``/v1/completions``: validation of
what a client sends (a ``RequestError``, answered with HTTP 400, names the field and what is wrong), the
chat template's rendering of the messages, and the response objects built from the sampled tokens.

A field OpenAI defines that this server does not implement (``top_logprobs``, penalties, a forced
``tool_choice``, ``response_format`` other than text, ``echo``, ``suffix``, ``seed``) is refused, never silently
ignored; bookkeeping fields (``user``, ``metadata``, ``store``, ``parallel_tool_calls``, ...) are accepted.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from hybridflow.tools import find_calls

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 64
# Fields a client may send that change nothing the server computes (accepted and left alone).
BOOKKEEPING = {"model", "user", "metadata", "store", "parallel_tool_calls", "stream_options", "service_tier"}
# Sampling fields accepted only at their neutral value.
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "top_logprobs": 0, "seed": None, "logit_bias": None}


class RequestError(ValueError):
    """A request the server refuses: HTTP ``status`` with a message naming the field and the fix."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    """What the server needs of a (chat) completion request, validated."""

    kind: str  # chat or text
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str = ""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    model: str = ""


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a number, got {value!r}")
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be in [{low}, {high}], got {value}")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
        bound = f"an integer >= {low}" + (f" and <= {high}" if high else "")
        raise RequestError(f"'{name}' must be {bound}, got {value!r}")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {value!r}")
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError(f"'stop' must be a non-empty string or a list of up to 4 of them, got {stop!r}")
    return tuple(stops)


def _check_fields(body: dict, known: set[str]) -> None:
    for name, neutral in NEUTRAL.items():
        if body.get(name, neutral) not in (neutral, None):
            raise RequestError(f"'{name}' is not supported by this server; leave it out (got {body[name]!r})")
    unknown = sorted(set(body) - known - BOOKKEEPING - set(NEUTRAL))
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; this server takes {sorted(known | BOOKKEEPING)}")
    if not isinstance(body.get("model", ""), str):
        raise RequestError(f"'model' must be a string, got {body['model']!r}")


COMMON = {"n", "temperature", "top_p", "max_tokens", "stop", "logprobs", "stream"}


def _common(body: dict, req: Request) -> Request:
    req.model = body.get("model") or ""
    req.n = _integer(body, "n", 1, MAX_N) or 1
    req.temperature = _number(body, "temperature", 0.0, 2.0)
    req.top_p = _number(body, "top_p", 0.0, 1.0)
    if req.top_p == 0.0:
        raise RequestError("'top_p' must be > 0")
    req.max_tokens = _integer(body, "max_tokens", 1)
    req.stop = _stops(body)
    req.stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, got {options!r}")
    req.include_usage = bool(options.get("include_usage"))
    return req


def parse_chat(body: Any) -> Request:
    """A validated chat-completions request (``RequestError`` otherwise)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_fields(
        body, COMMON | {"messages", "tools", "tool_choice", "max_completion_tokens", "response_format"}
    )
    req = _common(body, Request("chat"))
    if body.get("max_completion_tokens") is not None:
        req.max_tokens = _integer(body, "max_completion_tokens", 1)
    req.logprobs = _flag(body, "logprobs")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise RequestError(f"'response_format' {fmt!r} is not supported; only {{'type': 'text'}}")
    req.messages = [_message(m, i) for i, m in enumerate(_list(body, "messages"))]
    if not req.messages:
        raise RequestError("'messages' must hold at least one message")
    tools = body.get("tools")
    if tools is not None:
        req.tools = [_tool(t, i) for i, t in enumerate(_list(body, "tools"))] or None
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise RequestError(f"'tool_choice' {choice!r} is not supported; use 'auto' or 'none'")
    req.tool_choice = choice or "auto"
    return req


def parse_completion(body: Any) -> Request:
    """A validated (text) completions request."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_fields(body, COMMON | {"prompt", "echo", "suffix", "best_of"})
    for name, neutral in (("echo", False), ("suffix", None), ("best_of", None)):
        if body.get(name, neutral) not in (neutral, None, 1) or (name == "echo" and body.get(name)):
            raise RequestError(f"'{name}' is not supported by this server; leave it out")
    req = _common(body, Request("text"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string (or a list of one)")
    req.prompt = prompt
    lp = body.get("logprobs")
    if lp not in (None, 0, 1) or isinstance(lp, bool):
        raise RequestError(
            f"'logprobs' must be null, 0 or 1 here (top alternatives are not returned), got {lp!r}"
        )
    req.logprobs = lp is not None
    return req


def _list(body: dict, name: str) -> list:
    value = body.get(name)
    if not isinstance(value, list):
        raise RequestError(f"'{name}' must be a list, got {type(value).__name__}")
    return value


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}"
                )
            texts.append(part["text"])
        content = "".join(texts)
    if content is not None and not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string, a list of text parts or null")
    out: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls must be a list, on an assistant message")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    elif content is None and role != "assistant":
        raise RequestError(f"{where}.content is missing")
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(
            f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}"
        )
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            parsed = args  # kept as text: the template renders what it can
    else:
        parsed = args
    # Templates (Qwen's, Hermes') read arguments as a mapping.
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": parsed}}


def _tool(t: Any, i: int) -> dict[str, Any]:
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
        raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"tools[{i}].function.name must be a non-empty string")
    return {"type": "function", "function": fn}


def render(tokenizer: Any, req: Request) -> str:
    """The prompt text: the chat template over the messages (and tools), opening the assistant's turn."""
    if req.kind == "text":
        return req.prompt
    kwargs = {"tools": req.tools} if req.tools else {}
    try:
        return tokenizer.apply_chat_template(
            req.messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as exc:  # the template's own checks (e.g. roles that must alternate)
        raise RequestError(f"the model's chat template cannot render these messages: {exc}") from exc


def parse_tool_calls(text: str, req: Request, fmt: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """An answer's content and tool calls in OpenAI's form (calls only when the request offered tools)."""
    if not req.tools or req.tool_choice == "none":
        return text, None
    positional = {}
    for t in req.tools:
        fn = t["function"]
        required = (fn.get("parameters") or {}).get("required") or list(
            (fn.get("parameters") or {}).get("properties") or {}
        )
        if required:
            positional[fn["name"]] = required[0]
    parsed = find_calls(text, fmt, positional)
    if not parsed.calls:
        return text, None
    first = text.find(parsed.calls[0].raw)
    content = text[:first].strip() or None
    calls = [
        {
            "id": f"call_{secrets.token_hex(8)}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in parsed.calls
    ]
    return content, calls


def token_logprobs(tokenizer: Any, tokens: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    """OpenAI's per-token log-prob entries (no alternatives)."""
    out = []
    for t, lp in zip(tokens, logprobs):
        text = tokenizer.decode([t], skip_special_tokens=False)
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return out


def envelope(kind: str, model: str, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict:
    """A (chat) completion object or chunk around ``choices``."""
    obj = {
        "chat": "chat.completion",
        "chunk": "chat.completion.chunk",
        "text": "text_completion",
    }[kind]
    out = {"id": f"cmpl-{secrets.token_hex(12)}", "object": obj, "created": int(time.time()), "model": model,
           "choices": choices}  # fmt: skip
    if usage is not None:
        out["usage"] = usage
    return out
