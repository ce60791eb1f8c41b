"""The environment of multi-turn rollouts (``rollout.multi_turn``): the tools, and the chat template that turns
their output into the tokens of a tool turn.

``ToolEnvironment.respond`` decodes an assistant turn, parses its tool calls (``tools.find_calls``: the
Hermes/Qwen ``<tool_call>{json}</tool_call>`` format, or the plain ``[[name: argument]]`` one for tiny models),
runs at most ``max_parallel_calls`` of them at once (``ToolSet.run``: errors, timeouts and malformed calls come
back as text and are counted, never raised; a code-interpreter run that failed inside its sandbox is an
ordinary result whose text says so; calls past the cap are answered with an error), and renders the results
as one tool message through the chat template: the tokens from the end of the assistant turn (its end-of-turn
token, which the policy sampled) to the next assistant header, found as the difference between the template's
rendering with and without the tool message. Each result is cut to ``max_tool_response_length`` characters
first (verl's unit).

What the policy sampled is hostile input. A tool's output (an error echoing the name the policy asked for,
the code interpreter's stdout) never carries the tokenizer's special tokens into the next turn: each one is
broken by a zero-width space before it is rendered, so ``<|im_end|>`` in an output is text, not an end of
turn. Anything that still fails while answering a turn (a bug, a template that cannot render the text) is
that episode's error, counted in ``tool/env_errors``: the rollout goes on.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hybridflow.engine import AgentLoop, Episode, GenerationOutput, LoopLimits, ToolTurn

logger = logging.getLogger(__name__)

_DUMMY = [{"role": "user", "content": "_"}, {"role": "assistant", "content": "_"}]
_BREAK = "\u200b"  # zero-width space: splits a special token's text so that it tokenises as plain characters


def special_strings(tokenizer: Any) -> list[str]:
    """The texts the tokenizer turns into control tokens: its special tokens, and added markup tokens
    (``<tool_call>``), longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        text = str(getattr(added, "content", added))
        if getattr(added, "special", False) or (
            text.startswith("<") and text.endswith(">") and len(text) > 2
        ):
            found.add(text)
    return sorted((t for t in found if len(t) > 1), key=len, reverse=True)


def defuse(text: str, specials: list[str]) -> str:
    """``text`` with every occurrence of a special token's text broken after its first character."""
    for token in specials:
        if token in text:
            text = text.replace(token, token[0] + _BREAK + token[1:])
    return text


class ToolEnvironment:
    """Answers assistant turns with tool results (see the module doc)."""

    def __init__(
        self,
        tokenizer: Any,
        toolset: Any,
        fmt: str,
        max_chars: int,
        timeout_s: float,
        max_parallel_calls: int = 1,
        max_user_turns: int | None = None,
    ) -> None:
        self.tokenizer, self.toolset, self.fmt = tokenizer, toolset, fmt
        self.max_chars, self.timeout_s = max_chars, timeout_s
        self.max_parallel_calls, self.max_user_turns = max_parallel_calls, max_user_turns
        self.specials = special_strings(tokenizer)
        self.env_errors = 0  # turns the environment itself failed to answer

    def respond(self, episode: Episode, turn: list[int]) -> ToolTurn | None:
        """The tool turn's tokens after ``turn``, or None when the turn calls no tool (the episode ends)."""
        try:
            return self._respond(episode, turn)
        except Exception as exc:  # hostile text met a bug: this episode's error, never the run's
            self.env_errors += 1
            logger.warning("the tool environment failed on a turn (%s: %.200s)", type(exc).__name__, exc)
            logger.debug("the tool environment's failure", exc_info=True)
            try:
                message = f"error: the tool environment failed on this turn ({type(exc).__name__})"
                return ToolTurn(self.tool_tokens(message, turn[-1] if turn else None), 0, 1)
            except Exception:
                return None  # not even an error message renders: the episode ends here

    def _respond(self, episode: Episode, turn: list[int]) -> ToolTurn | None:
        text = self.tokenizer.decode(turn, skip_special_tokens=False)
        parsed = self.toolset.parse(text, self.fmt)  # plain calls bound to their tool's parameter
        if not parsed.has_calls:
            return None
        if self.max_user_turns is not None and episode.tool_turns >= self.max_user_turns:
            return None  # verl's max_user_turns: the episode ends with this turn, its calls unanswered
        calls, skipped = parsed.calls[: self.max_parallel_calls], parsed.calls[self.max_parallel_calls :]
        results = [f"error: {e}" for e in parsed.errors]
        done = self._run(calls)
        errors = len(parsed.errors) + sum(r.error is not None for r in done) + len(skipped)
        results += [r.text for r in done]  # an error's text says what went wrong, for the model to read
        if skipped:
            results.append(
                f"error: {len(skipped)} more tool call(s) in this turn were not run: at most "
                f"{self.max_parallel_calls} run per turn (rollout.multi_turn.max_parallel_calls)"
            )
        content = "\n".join(defuse(r[: self.max_chars], self.specials) for r in results)
        tokens = self.tool_tokens(content, turn[-1] if turn else None)
        return ToolTurn(tokens, len(calls), errors, len(parsed.errors), len(skipped))

    def _run(self, calls: list[Any]) -> list[Any]:
        """Run the calls of one turn, concurrently when there are several."""
        if len(calls) <= 1:
            return [self.toolset.run(call, self.timeout_s) for call in calls]
        with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="tool-call") as pool:
            return list(pool.map(lambda call: self.toolset.run(call, self.timeout_s), calls))

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


def episode_metrics(episodes: list[Episode], env_errors: int = 0) -> dict[str, float]:
    """verl's multi-turn metrics over a rollout's episodes, and the ``tool/*`` counts of the rollout."""
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
        "tool/parse_errors": float(sum(e.tool_parse_errors for e in episodes)),
        "tool/skipped_calls": float(sum(e.tool_skipped for e in episodes)),
        "tool/env_errors": float(env_errors),
    }


def sandbox_limits(mt: Any) -> Any:
    """``rollout.multi_turn``'s code-interpreter limits as ``SandboxLimits`` (the timeout is the tools')."""
    from hybridflow.tools import SandboxLimits

    box = mt.sandbox
    return SandboxLimits(
        timeout_s=mt.tool_timeout_s,
        memory_bytes=box.memory_mb << 20,
        processes=box.processes,
        scratch_bytes=box.scratch_mb << 20,
        file_bytes=box.file_mb << 20,
    )


def builtin_toolset(names: list[str], config_path: str | None = None, multi_turn: Any = None) -> Any:
    """The ``ToolSet`` of ``rollout.multi_turn``: the built-in ``tools`` (``calc``, ``code_interpreter``, the
    latter with ``multi_turn``'s sandbox settings) and those declared in ``tool_config_path`` (a YAML file:
    ``tools:`` a list of ``tools.tool_from_spec`` specs)."""
    from hybridflow.tools import ToolSet, calculator_tool, code_interpreter_tool, tool_from_spec

    def code_interpreter() -> Any:
        if multi_turn is None:
            return code_interpreter_tool()
        return code_interpreter_tool(sandbox_limits(multi_turn), multi_turn.sandbox.allow_unisolated)

    makers = {"calc": calculator_tool, "code_interpreter": code_interpreter}
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


class _Follower:
    """The environment of a rollout group's other ranks: the group's first rank runs the tools, and its answers
    reach every rank through ``agree`` (a code run or a tool's side effect happens once, not once per rank)."""

    env_errors = 0

    def respond(self, episode: Episode, turn: list[int]) -> ToolTurn | None:
        return None  # never used: the loop takes the first rank's answer for every episode


def leads(group: Any) -> bool:
    """Whether this rank runs its rollout group's tools (the group's first rank; every rank at tp = 1)."""
    if group.group is None:
        return True
    import torch.distributed as dist

    return dist.get_rank() == group.view.group_ranks(group.dp_rank)[0]


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
            builtin_toolset(mt.tools, mt.tool_config_path, mt),
            mt.format,
            mt.max_tool_response_length,
            mt.tool_timeout_s,
            mt.max_parallel_calls,
            mt.max_user_turns,
        )
        self.limits = LoopLimits(mt.max_assistant_turns, cfg.data.max_response_length)

    def generate(
        self, engine: Any, prompts: list[list[int]], params: Any, group: Any, progress: Any = None
    ) -> tuple[list[list[Any]], list[list[int]], dict[str, float]]:
        """Episodes as ``GenerationOutput`` groups (log-prob 0 on tool tokens), their masks (flat, 1 on
        sampled tokens) and the rollout's multi-turn metrics; ``progress(1)`` as each episode ends."""

        agree = group_agree(group)
        env = self.env if leads(group) else _Follower()
        loop = AgentLoop(engine, env, self.limits, **({"agree": agree} if agree else {}))
        failed_before = env.env_errors
        episodes = loop.run(prompts, params, progress)
        outputs = [
            [
                GenerationOutput(e.tokens, [0.0 if m == 0 else p for p, m in zip(e.logprobs, e.mask)],
                                 e.finish_reason or "length")
                for e in g
            ]
            for g in episodes
        ]  # fmt: skip
        flat = [e for g in episodes for e in g]
        return outputs, [e.mask for e in flat], episode_metrics(flat, env.env_errors - failed_before)
