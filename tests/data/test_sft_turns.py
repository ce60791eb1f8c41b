"""Multi-turn SFT rows (``data.sft_turns``): conversations with tool turns rendered turn by turn through
Qwen2-style (ChatML) and Llama-3-style chat templates, with the loss mask exactly on the assistant turns; the
tokens agree with what the agent loop builds in a rollout; bad rows are refused naming the row and the fix."""

from __future__ import annotations

import pytest

from hybridflow.data import SFTDataset, collate_sft, make_task
from hybridflow.data.rows import RowOrigin
from hybridflow.data.sft_turns import check_conversation, encode_conversation
from hybridflow.models import build_char_tokenizer
from hybridflow.utils.errors import UserError

LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _llama_tokenizer():
    tok = build_char_tokenizer()
    extra = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok.add_tokens(extra, special_tokens=True)
    tok.chat_template = LLAMA_TEMPLATE
    return tok


TOKENIZERS = {"qwen2": (build_char_tokenizer, "<|im_end|>"), "llama": (_llama_tokenizer, "<|eot_id|>")}

CONVERSATIONS = [
    [
        {"role": "user", "content": "347*581="},
        {"role": "assistant", "content": "[[calc: 347*581]]"},
        {"role": "tool", "content": "201607"},
        {"role": "assistant", "content": "#### 201607"},
    ],
    [
        {"role": "system", "content": "You can call calc."},
        {"role": "user", "content": "What is (12+3)*4/5, then that times 1234?"},
        {"role": "assistant", "content": "First the bracket. [[calc: (12+3)*4/5]]"},
        {"role": "tool", "content": "12.0"},
        {"role": "assistant", "content": '<tool_call>{"name": "calc", "arguments": {"expression": "12*1234"}}</tool_call>'},
        {"role": "tool", "content": "14808"},
        {"role": "tool", "content": "(cached)"},
        {"role": "assistant", "content": "So the answer is #### 14808, after two calls."},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! Ask me anything."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "#### 4"},
    ],
]  # fmt: skip


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_the_mask_covers_exactly_the_assistant_turns(family: str) -> None:
    make, end = TOKENIZERS[family]
    tok = make()
    for turns in CONVERSATIONS:
        prompt, response, mask = encode_conversation(tok, check_conversation(turns, RowOrigin("t", 0)))
        assert len(response) == len(mask)
        whole = tok.apply_chat_template(turns, tokenize=False).rstrip()
        assert prompt + response == tok(whole, add_special_tokens=False)["input_ids"]  # the same tokens
        trained = tok.decode([t for t, m in zip(response, mask) if m])
        assistants = [t["content"].strip() for t in turns if t["role"] == "assistant"]
        assert trained == "".join(a + end for a in assistants)
        runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        assert runs == len(assistants)  # one trained stretch per assistant turn, nothing else
        untrained = tok.decode([t for t, m in zip(response, mask) if not m])
        for turn in turns[[t["role"] for t in turns].index("assistant") :]:
            if turn["role"] != "assistant":
                assert turn["content"] in untrained


def test_sft_tokens_equal_the_rollouts_tokens_of_the_same_episode() -> None:
    from hybridflow.workers.agent_env import ToolEnvironment, builtin_toolset

    tok = build_char_tokenizer()
    turns = CONVERSATIONS[0]
    _, response, mask = encode_conversation(tok, turns)
    env = ToolEnvironment(tok, builtin_toolset(["calc"]), "plain", 256, 5.0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call = [*tok.encode("[[calc: 347*581]]", add_special_tokens=False), end]
    answer = [*tok.encode("#### 201607", add_special_tokens=False), end]
    tool = env.respond(None, call).tokens  # runs calc: 347*581 = 201607
    assert response == call + tool + answer
    assert mask == [1] * len(call) + [0] * len(tool) + [1] * len(answer)


def test_the_dataset_mixes_pairs_and_conversations(tok) -> None:
    pair = {"prompt": [{"role": "user", "content": "1+1="}], "response": "#### 2"}
    rows = [*make_task("multiply", "train", 6, seed=0, call_fraction=0.5), pair]
    ds = SFTDataset(rows, tok, max_length=128)
    calls = 0
    for row, item in zip(rows, ds):
        trained = tok.decode([t for t, m in zip(item["input_ids"], item["loss_mask"]) if m])
        answer = row.get("response") or row["extra_info"]["answer"]
        assert trained.endswith(answer + "<|im_end|>")
        if "[[calc:" in trained:
            calls += 1
            product = row["reward_model"]["ground_truth"]
            assert (
                tok.decode(item["input_ids"]).count(product) == 2
            )  # the tool's result (mask 0) and the answer
    assert 0 < calls < 6
    batch = collate_sft(ds.items, tok.pad_token_id)
    assert batch["loss_mask"].sum().item() == sum(sum(it["loss_mask"]) for it in ds.items)


CALL = [{"role": "assistant", "content": "[[calc: 1+1]]"}, {"role": "tool", "content": "2"}]
BAD = [
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}],
     "messages[1] is a tool turn without a preceding call"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "I will not call"},
      {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}],
     "messages[2] is a tool turn without a preceding call"),
    ([{"role": "user", "content": "x"}, *CALL, {"role": "assistant", "content": "  "}],
     "messages[3] is an empty assistant"),
    ([{"role": "user", "content": "x"}, *CALL], "ends with a tool turn"),
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}, *CALL,
      {"role": "assistant", "content": "y"}], "must start with a user turn"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "be brief"}, *CALL,
      {"role": "assistant", "content": "y"}], "messages[1] is a system turn after the first turn"),
]  # fmt: skip


@pytest.mark.parametrize(("messages", "said"), BAD)
def test_bad_conversations_are_refused_naming_the_row_and_the_fix(tok, messages, said: str) -> None:
    good = {"messages": CONVERSATIONS[0]}
    with pytest.raises(UserError) as info:
        SFTDataset([good, good, {"messages": messages}], tok, max_length=256, source="chats.jsonl")
    assert "chats.jsonl: row 2" in str(info.value) and said in str(info.value)


def test_trainer_sft_rows_carry_the_same_masks(tok) -> None:
    from hybridflow.trainer.sft import encode_pairs

    rows = make_task("multiply", "train", 8, seed=1, call_fraction=0.5)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts, responses, masks, _ = encode_pairs(tok, rows, end)
    ds = SFTDataset(rows, tok, max_length=128)
    for p, r, m, item in zip(prompts, responses, masks, ds):
        assert p + r == item["input_ids"] and [0] * len(p) + m == item["loss_mask"]
    assert len({len(r) for r in responses}) > 1  # calls and direct answers: different lengths
    assert all(m == [1] * len(r) for r, m, row in zip(responses, masks, rows) if len(row["messages"]) == 2)
