"""The environment of multi-turn rollouts (``rollout.multi_turn``): the tools, and the chat template that turns
their output into the tokens of a tool turn.

``ToolEnvironment.respond`` decodes an assistant turn, parses its tool calls (``tools.find_calls``: the
Hermes/Qwen ``<tool_call>{json}</tool_call>`` format, or the plain ``[[name: argument]]`` one for tiny models),
runs each (``ToolSet.run``: errors, timeouts and malformed calls come back as text and are counted, never
raised; a code-interpreter run that failed inside its sandbox is an ordinary result whose text says so), and renders the results as one tool message through the chat template: the tokens from the end of
the assistant turn (its end-of-turn token, which the policy sampled) to the next assistant header, found as
the difference between the template's rendering with and without the tool message. Each result is cut to
``max_tool_response_length`` characters first (verl's unit).
"""

from __future__ import annotations

from typing import Any

from hybridflow.engine import AgentLoop, Episode, GenerationOutput, LoopLimits, ToolTurn

_DUMMY = [{"role": "user", "content": "_"}, {"role": "assistant", "content": "_"}]


class ToolEnvironment:
    """Answers assistant turns with tool results (see the module doc)."""

    def __init__(self, tokenizer: Any, toolset: Any, fmt: str, max_chars: int, timeout_s: float) -> None:
        self.tokenizer, self.toolset, self.fmt = tokenizer, toolset, fmt
        self.max_chars, self.timeout_s = max_chars, timeout_s

    def respond(self, episode: Episode, turn: list[int]) -> ToolTurn | None:
        """The tool turn's tokens after ``turn``, or None when the turn calls no tool (the episode ends)."""
        text = self.tokenizer.decode(turn, skip_special_tokens=False)
        parsed = self.toolset.parse(text, self.fmt)  # plain calls bound to their tool's parameter
        if not parsed.calls and not parsed.errors:
            return None
        results = [f"error: {e}" for e in parsed.errors]
        errors = len(parsed.errors)
        for call in parsed.calls:
            result = self.toolset.run(call, self.timeout_s)
            errors += result.error is not None
            results.append(result.text)  # an error's text says what went wrong, for the model to read
        content = "\n".join(r[: self.max_chars] for r in results)
        return ToolTurn(self.tool_tokens(content, turn[-1] if turn else None), len(parsed.calls), errors)

    def tool_tokens(self, content: str, end_token: int | None) -> list[int]:
        """The tokens of a tool message with ``content`` after an assistant turn that ended with ``end_token``,
        up to and including the next assistant header (the template's own text, never re-tokenising the turn)."""
        tok = self.tokenizer
        before = tok.apply_chat_template(_DUMMY, tokenize=False)
        after = tok.apply_chat_template(
            [*_DUMMY, {"role": "tool", "content": content}], tokenize=False, add_generation_prompt=True
        )
        if not after.startswith(before):
            raise ValueError(
                "the chat template renders earlier messages differently once a tool message follows"
            )
        end = tok.decode([end_token], skip_special_tokens=False) if end_token is not None else ""
        # The assistant turn ended with its end-of-turn token (sampled); whatever the template puts after that
        # token (a newline) belongs to the tool turn's tokens.
        tail = before[before.rindex(end) + len(end) :] if end and end in before else ""
        return tok.encode(tail + after[len(before) :], add_special_tokens=False)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """verl's multi-turn metrics over a rollout's episodes."""
    turns = [e.turns for e in episodes]
    tool_tokens = sum(len(e.mask) - sum(e.mask) for e in episodes)
    tokens = sum(len(e.mask) for e in episodes)
    return {
        "num_turns/mean": sum(turns) / max(len(turns), 1),
        "num_turns/min": float(min(turns, default=0)),
        "num_turns/max": float(max(turns, default=0)),
        "tool_call_counts/mean": sum(e.tool_calls for e in episodes) / max(len(episodes), 1),
        "tool_errors/mean": sum(e.tool_errors for e in episodes) / max(len(episodes), 1),
        "response_length/tool_fraction": tool_tokens / max(tokens, 1),
    }


def builtin_toolset(names: list[str], config_path: str | None = None) -> Any:
    """The ``ToolSet`` of ``rollout.multi_turn``: the built-in ``tools`` (``calc``, ``code_interpreter``) and
    those declared in ``tool_config_path`` (a YAML file: ``tools:`` a list of ``tools.tool_from_spec`` specs)."""
    from hybridflow.tools import ToolSet, calculator_tool, code_interpreter_tool, tool_from_spec

    makers = {"calc": calculator_tool, "code_interpreter": code_interpreter_tool}
    tools = [makers[name]() for name in names]
    if config_path:
        tools += [tool_from_spec(spec) for spec in _tool_specs(config_path)]
    return ToolSet(tools)


def _tool_specs(path: str) -> list[Any]:
    """The ``tools:`` list of a tool config file (UserError naming the file and the fix otherwise)."""
    import yaml

    from hybridflow.utils.errors import UserError

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"rollout.multi_turn.tool_config_path={path!r}: cannot read it ({exc})") from exc
    specs = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(specs, list) or not specs:
        raise UserError(
            f"rollout.multi_turn.tool_config_path={path!r} has no 'tools:' list; write tools: followed by one "
            "mapping per tool with name, description, parameters and function ('module.path:function_name')"
        )
    return specs


def group_agree(group: Any) -> Any:
    """``agree`` for the agent loop: identity at tp = 1, else rank 0 of the rollout group's object, broadcast."""
    if group.group is None:
        return None
    import torch.distributed as dist

    first = group.view.group_ranks(group.dp_rank)[0]

    def agree(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=first, group=group.group)
        return box[0]

    return agree


class MultiTurn:
    """The actor's multi-turn rollouts: the environment, the loop's limits, and the packing of episodes."""

    def __init__(self, cfg: Any, tokenizer: Any) -> None:

        mt = cfg.rollout.multi_turn
        self.env = ToolEnvironment(
            tokenizer,
            builtin_toolset(mt.tools, mt.tool_config_path),
            mt.format,
            mt.max_tool_response_length,
            mt.tool_timeout_s,
        )
        self.limits = LoopLimits(mt.max_assistant_turns, cfg.data.max_response_length)

    def generate(
        self, engine: Any, prompts: list[list[int]], params: Any, group: Any
    ) -> tuple[list[list[Any]], list[list[int]], dict[str, float]]:
        """Episodes as ``GenerationOutput`` groups (log-prob 0 on tool tokens), their masks (flat, 1 on
        sampled tokens) and the rollout's multi-turn metrics."""

        agree = group_agree(group)
        loop = AgentLoop(engine, self.env, self.limits, **({"agree": agree} if agree else {}))
        episodes = loop.run(prompts, params)
        outputs = [
            [
                GenerationOutput(e.tokens, [0.0 if m == 0 else p for p, m in zip(e.logprobs, e.mask)],
                                 e.finish_reason or "length")
                for e in g
            ]
            for g in episodes
        ]  # fmt: skip
        flat = [e for g in episodes for e in g]
        return outputs, [e.mask for e in flat], episode_metrics(flat)
