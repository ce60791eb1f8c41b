"""The endpoint through the real ``openai`` client: n > 1 with log-probs, streaming, a tool-calling model's
three-turn episode kept token for token (the trained tokens are the sampled ones, their log-probs the model's
own recomputation), a rewritten history split into two sequences, and the HTTP guards (loopback, the run's
token, size and format of requests)."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import openai
import pytest
import torch
from conftest import CALC_TOOL, LESSON


def test_n_choices_with_logprobs_and_models(served) -> None:
    client = served.client()
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there, 12*3?"}], n=3, max_tokens=12,
        logprobs=True,
    )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        entries = choice.logprobs.content
        assert entries and all(e.logprob <= 0 and math.isfinite(e.logprob) for e in entries)
        assert choice.finish_reason in ("stop", "length")
    # one entry per sampled token of the content; an answer that stopped also sampled its end token
    ends = sum(c.finish_reason == "stop" for c in reply.choices)
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices) + ends
    assert [m.id for m in client.models.list().data] == ["hybridflow"]
    text = client.completions.create(model="tiny", prompt="abc", max_tokens=5)
    assert text.choices[0].finish_reason in ("stop", "length") and text.usage.completion_tokens <= 5


def test_stream_delivers_the_answer_the_episode_keeps(served) -> None:
    key, traj = served.endpoint.open_episode()
    stream = served.client(key).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=20, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    (seq,) = traj.leaves()
    sampled = [t for t, m in zip(seq.response, seq.mask) if m]
    assert served.tokenizer.decode([t for t in sampled if t not in served.eos]) == text
    served.endpoint.close_episode(key)


def recomputed_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1, by one forward over the whole row (float32)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)


def test_three_turn_episode_trains_exactly_the_sampled_tokens(caller) -> None:
    key, traj = caller.endpoint.open_episode()
    client = caller.client(key)
    messages, answers = [LESSON[0]], []
    for turn in range(3):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, tools=[CALC_TOOL], temperature=0, max_tokens=30, logprobs=True
        )
        message = reply.choices[0].message
        answers.append(reply.choices[0])
        if turn < 2:  # the taught calls come back as OpenAI tool calls
            assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
            (call,) = message.tool_calls
            assert call.function.name == "calc"
            expression = json.loads(call.function.arguments)["expression"]
            assert expression == ["2*3", "6*7"][turn]
            messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expression))})
        else:
            assert message.content == "#### 42" and reply.choices[0].finish_reason == "stop"
    (seq,) = traj.leaves()  # one training row: every request continued the last
    assert traj.requests == 3 and traj.splits == 0
    # The trained tokens (mask 1) are exactly the sampled ones, turn after turn (each with its end token).
    end = caller.eos[1]
    sampled = [t for t, m in zip(seq.response, seq.mask) if m]
    tokenizer = caller.tokenizer
    want = [
        [*tokenizer.encode(text, add_special_tokens=False), end]
        for text in ("[[calc: 2*3]]", "[[calc: 6*7]]", "#### 42")
    ]
    assert sampled == [t for w in want for t in w]
    # What lies between the turns (the tool turns and headers) is masked, and the row is the conversation.
    full = tokenizer.apply_chat_template(LESSON, tokenize=False)
    assert full.startswith(tokenizer.decode(seq.tokens, skip_special_tokens=False))
    assert sum(1 - m for m in seq.mask) > 0
    # The returned log-probs are the trained tokens', and equal the model's recomputation over the whole row.
    returned = [e.logprob for a in answers for e in a.logprobs.content]
    trained = [p for p, m in zip(seq.logprobs, seq.mask) if m]
    assert len(returned) == len(trained) - 3  # the end tokens are trained, not shown
    again = recomputed_logprobs(caller.model, seq.tokens)[seq.prompt_len - 1 :]
    mask = torch.tensor(seq.mask, dtype=torch.bool)
    diff = (again[mask] - torch.tensor(seq.logprobs)[mask]).abs().max()
    assert diff <= 1e-5, diff
    assert all(v == 0 for v, m in zip(seq.versions, seq.mask) if m)
    caller.endpoint.close_episode(key)


def test_a_rewritten_history_starts_a_second_sequence(caller) -> None:
    key, traj = caller.endpoint.open_episode()
    client = caller.client(key)
    first = client.chat.completions.create(model="tiny", messages=[LESSON[0]], temperature=0, max_tokens=30)
    said = first.choices[0].message.content
    history = [LESSON[0], {"role": "assistant", "content": said}, LESSON[2]]
    client.chat.completions.create(model="tiny", messages=history, temperature=0, max_tokens=30)
    assert len(traj.leaves()) == 1  # continued
    summary = [{"role": "user", "content": "Earlier: 2*3 was 6. What is 6*7?"}]  # the harness summarised
    client.chat.completions.create(model="tiny", messages=summary, temperature=0, max_tokens=30)
    rows = traj.leaves()
    assert len(rows) == 2 and traj.splits == 1
    assert rows[1].tokens[: rows[1].prompt_len] == caller.tokenizer.apply_chat_template(
        summary, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert all(m == 1 for m in rows[1].mask)  # a fresh row: nothing in its response was appended
    caller.endpoint.close_episode(key)


def _post(served, path: str, body: bytes, token: str | None = "run") -> tuple[int, dict]:
    token = served.endpoint.token if token == "run" else token
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    url = served.endpoint.base_url().removesuffix("/v1") + path
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_loopback_token_size_and_format_are_enforced(served) -> None:
    host, _port = served.endpoint._runner.addresses[0][:2]
    assert host == "127.0.0.1" and served.endpoint.base_url().startswith("http://127.0.0.1:")
    with pytest.raises(openai.AuthenticationError):
        served.client().with_options(api_key="wrong").models.list()
    ok = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    assert _post(served, "/v1/chat/completions", ok, token=None)[0] == 401
    assert _post(served, "/v1/chat/completions", ok)[0] == 200
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (70 << 10)}]}).encode()
    status, body = _post(served, "/v1/chat/completions", big)
    assert status == 413 and "limit" in body["error"]["message"]
    cases = {
        b"{not json": "not valid JSON",
        b"[1, 2]": "JSON object",
        json.dumps({"messages": []}).encode(): "at least one message",
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(): "messages[0].role",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}).encode(): "'n'",
        json.dumps(
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}
        ).encode(): "'temperature'",
        json.dumps(
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}
        ).encode(): "top_logprobs",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "colour": 1}).encode(): "colour",
    }
    for body_bytes, needle in cases.items():
        status, body = _post(served, "/v1/chat/completions", body_bytes)
        assert status == 400 and needle in body["error"]["message"], (body_bytes, body)
    status, body = _post(served, "/ep/nosuch/v1/chat/completions", ok)
    assert status == 404 and "no episode" in body["error"]["message"]
