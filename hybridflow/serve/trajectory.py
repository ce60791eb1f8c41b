"""Token-in, token-out trajectories of an episode served over the OpenAI-compatible endpoint.

A harness sees text: it re-sends the conversation so far with every request, and a server that re-tokenised
it would train on tokens the policy never sampled (a BPE merge across the turn's edge, a chat template that
renders an earlier turn differently). Here each episode keeps what it actually sampled: a ``Sequence`` is the
exact token ids of one training row (its first prompt, then every sampled token, log-prob and weight version,
and the tokens appended between turns). A request's prompt is matched against them as text:

1. Each assistant message that is one of this episode's own answers (the same content and tool calls as the
   server returned) is rendered from the text the policy sampled, never from the client's re-encoding of it
   (a template that would re-format the tool calls' JSON cannot drift).
2. The longest sequence whose decoded text is a prefix of the rendered prompt is continued: its tokens are
   kept as they are and only the text after them is tokenised (a tool result, the next user turn, the next
   assistant header), appended with mask 0 and prefilled; the answer's sampled tokens follow with mask 1.
3. No sequence matches (the harness summarised, dropped or edited a turn): the prompt starts a new sequence,
   so the episode becomes several training rows, and no token that was never sampled is ever trained on.

A sequence that a later request continued is not a training row itself (its continuation holds it); the
episode's rows are its leaves. With ``n > 1`` each choice is its own leaf until one is continued.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sequence:
    """One training row of an episode: ``tokens[:prompt_len]`` the prompt, then the response."""

    tokens: list[int]
    prompt_len: int
    text: str  # decode(tokens), special tokens kept: what a re-sent conversation must start with
    logprobs: list[float] = field(default_factory=list)  # per response token, nan where not sampled
    mask: list[int] = field(default_factory=list)  # per response token: 1 sampled, 0 appended
    versions: list[int] = field(default_factory=list)  # per response token: the weights' version, -1 appended
    continued: bool = False  # a later request of the episode continued it: not a leaf
    # What a completions client holds after the last answer: the prompt it sent and the answer's text, which
    # leaves out the end-of-turn token that ended it (OpenAI's): re-sent, it continues this row with the
    # sampled end token kept in place. None when the answer's decode does not extend the prompt's.
    shown: str | None = None

    @property
    def response(self) -> list[int]:
        """The tokens after the prompt."""
        return self.tokens[self.prompt_len :]


@dataclass
class Prompt:
    """A request's prompt as the engine gets it, and the sequence it continues (None: a new sequence)."""

    ids: list[int]
    base: Sequence | None
    response_so_far: int  # tokens after the base's prompt before this request's answer (0 for a new one)
    text: str = ""  # the prompt as the request rendered it


def message_key(content: Any, tool_calls: Any) -> str:
    """A fingerprint of an assistant message as a client re-sends it: its content and its tool calls'
    names and arguments (ids and whitespace in the arguments' JSON do not count)."""
    calls = []
    for call in tool_calls or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", "")
        with contextlib.suppress(ValueError, TypeError):  # not JSON: compared as the string it is
            args = json.dumps(json.loads(args) if isinstance(args, str) else args, sort_keys=True)
        calls.append([fn.get("name"), args])
    return json.dumps([content or "", calls])


class Trajectory:
    """What one episode sampled: its sequences and its answers' texts (see the module doc). Thread-safe."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sequences: list[Sequence] = []
        self.answers: dict[str, str] = {}  # message_key of a returned message -> the text the policy sampled
        self.requests = 0
        self.splits = 0  # requests that matched no sequence of an episode that had one
        self.lock = threading.Lock()

    def raw_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with each of this episode's own answers as the text the policy sampled."""
        out = []
        for m in messages:
            if m.get("role") == "assistant":
                raw = self.answers.get(message_key(m.get("content"), m.get("tool_calls")))
                if raw is not None:
                    m = {"role": "assistant", "content": raw}
            out.append(m)
        return out

    def prompt(self, text: str) -> Prompt:
        """The token ids of a rendered prompt: a held sequence's tokens plus the new text's, or a new start."""
        with self.lock:
            self.requests += 1
            best, held = None, ""  # the longest held text the prompt starts with: a row's decode or shown
            for s in self.sequences:
                for known in (s.text, s.shown):
                    if (
                        known is not None
                        and text.startswith(known)
                        and (best is None or len(known) > len(held))
                    ):
                        best, held = s, known
            if best is None:
                if self.sequences:
                    self.splits += 1
                return Prompt(self.tokenizer.encode(text, add_special_tokens=False), None, 0, text)
        rest = self.tokenizer.encode(text[len(held) :], add_special_tokens=False) if text != held else []
        return Prompt(best.tokens + rest, best, len(best.tokens) + len(rest) - best.prompt_len, text)

    def record(
        self,
        prompt: Prompt,
        sampled: list[int],
        logprobs: list[float],
        versions: list[int],
        key: str,
        raw: str,
        ended: bool = False,
    ) -> None:
        """Keep one answer: its sampled tokens after ``prompt`` (a new leaf) and the message it came back as;
        ``ended``: its last sampled token is the end-of-turn token its text leaves out."""
        with self.lock:
            base = prompt.base
            if base is None:
                seq = Sequence(list(prompt.ids), len(prompt.ids), "")
            else:
                added = len(prompt.ids) - len(base.tokens)
                seq = Sequence(
                    list(prompt.ids),
                    base.prompt_len,
                    "",
                    base.logprobs + [math.nan] * added,
                    base.mask + [0] * added,
                    base.versions + [-1] * added,
                )
                base.continued = True
            seq.tokens += sampled
            seq.logprobs += logprobs
            seq.mask += [1] * len(sampled)
            seq.versions += versions
            seq.text = self.tokenizer.decode(seq.tokens, skip_special_tokens=False)
            seq.shown = self._shown(prompt, sampled[:-1] if ended else sampled)
            self.sequences.append(seq)
            self.answers[key] = raw

    def _shown(self, prompt: Prompt, answer: list[int]) -> str | None:
        """The prompt's text and what ``answer`` adds to its decode (a join's space included), or None when
        the answer's decode does not extend the prompt's (a character split across the edge)."""
        before = self.tokenizer.decode(prompt.ids, skip_special_tokens=False)
        after = self.tokenizer.decode(prompt.ids + answer, skip_special_tokens=False)
        return prompt.text + after[len(before) :] if after.startswith(before) else None

    def leaves(self) -> list[Sequence]:
        """The episode's training rows: the sequences no later request continued, in the order they began."""
        with self.lock:
            return [s for s in self.sequences if not s.continued]
