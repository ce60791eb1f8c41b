"""The multi-turn environment of the actor: tool turns rendered by the chat template as tokens that continue
exactly what the policy sampled, tool calls parsed and run with errors counted, and verl's metrics."""

from __future__ import annotations

import pytest

from hybridflow.engine.rollout.agent_loop import Episode
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.utils.errors import UserError
from hybridflow.workers.agent_env import ToolEnvironment, builtin_toolset, episode_metrics


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=1)[1]


def test_the_tool_turn_continues_the_conversation_token_for_token(tokenizer) -> None:
    env = ToolEnvironment(tokenizer, builtin_toolset(["calc"]), "plain", 256, 5.0)
    question = [{"role": "user", "content": "What is 12*34?"}]
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn = [*tokenizer.encode("[[calc: 12*34]]", add_special_tokens=False), end]
    answer = env.respond(Episode(list(prompt)), turn)
    assert answer is not None and answer.calls == 1 and answer.errors == 0
    whole = tokenizer.encode(
        tokenizer.apply_chat_template(
            [
                *question,
                {"role": "assistant", "content": "[[calc: 12*34]]"},
                {"role": "tool", "content": "408"},
            ],
            add_generation_prompt=True,
            tokenize=False,
        ),
        add_special_tokens=False,
    )
    assert list(prompt) + turn + answer.tokens == list(whole)  # nothing before the tool turn re-tokenised


def test_errors_and_malformed_calls_are_counted_and_shown_to_the_model(tokenizer) -> None:
    env = ToolEnvironment(tokenizer, builtin_toolset(["calc"]), "hermes", 40, 5.0)
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    text = '<tool_call>{"name": "calc", "arguments": {"expression": "2**10**10"}}</tool_call><tool_call>{bad</tool_call>'
    answer = env.respond(Episode([1]), tokenizer.encode(text, add_special_tokens=False) + end)
    assert answer is not None and answer.errors == 2
    shown = tokenizer.decode(answer.tokens)
    assert "rror" in shown and len(shown) < 40 * 2 + 60  # each result cut to max_tool_response_length
    assert env.respond(Episode([1]), tokenizer.encode("just 42", add_special_tokens=False) + end) is None


def test_the_metrics_carry_verls_names() -> None:
    a = Episode([1], tokens=[5, 6, 7, 8], mask=[1, 0, 0, 1], turns=2, tool_calls=1)
    b = Episode([1], tokens=[5], mask=[1], turns=1)
    m = episode_metrics([a, b])
    assert m == {
        "num_turns/mean": 1.5,
        "num_turns/min": 1.0,
        "num_turns/max": 2.0,
        "tool_call_counts/mean": 0.5,
        "tool_errors/mean": 0.0,
        "response_length/tool_fraction": 0.4,
    }


def test_tools_declared_in_a_yaml_file_join_the_built_in_ones(tokenizer, tmp_path, monkeypatch) -> None:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))  # tool_funcs.py
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - name: echo\n"
        "    description: says the text back\n"
        "    parameters: {type: object, properties: {text: {type: string}}, required: [text]}\n"
        "    function: tool_funcs:echo\n"
    )
    env = ToolEnvironment(tokenizer, builtin_toolset(["calc"], str(path)), "plain", 256, 5.0)
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    answer = env.respond(Episode([1]), [*tokenizer.encode("[[echo: hi]] [[calc: 6*7]]"), *end])
    assert answer is not None and answer.calls == 2 and answer.errors == 0
    shown = tokenizer.decode(answer.tokens)
    assert "echo: hi" in shown and "42" in shown
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools: []\n")
    with pytest.raises(UserError, match="tool_config_path"):
        builtin_toolset([], str(bad))
