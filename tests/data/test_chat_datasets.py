"""Chat datasets as people hold them: ultrachat_200k, TRL's conversational formats and verl's schema, as lists
of dicts, as ``datasets.Dataset`` and as the files of ``data.train_files``, down to the prompt token ids."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
from support.chat_rows import (
    CHINESE_ANSWER,
    CHINESE_PROMPT,
    as_dataset,
    trl_conversational_rows,
    ultrachat_rows,
    verl_rows,
)

from hybridflow.api.notebook import build_dataset
from hybridflow.config import DataConfig, load_config
from hybridflow.data import (
    DataError,
    RLDataset,
    build_rl_dataset,
    collate_prompts,
    load_split_rows,
    save_rows,
)
from hybridflow.data.user_rows import DEFAULT_SOURCE, as_rows
from hybridflow.models.tiny import SPECIAL_TOKENS
from hybridflow.rewards import RewardManager
from hybridflow.rewards.shapes import recognise_reward
from hybridflow.trainer.sft import encode_pairs

FORMS = {"list": list, "dataset": as_dataset}
LOGGER = "hybridflow.data"
BOTH = "have both a 'prompt' string and 'messages': the prompt is taken from messages"


def _chatml(turns: list[dict]) -> str:
    """What the char tokenizer's ChatML template makes of ``turns`` with the generation prompt (by hand)."""
    return (
        "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns)
        + "<|im_start|>assistant\n"
    )


def _bytes(text: str) -> list[int]:
    """The char tokenizer's ids of plain text: one per UTF-8 byte (no extra chars), after the specials."""
    return [len(SPECIAL_TOKENS) + b for b in text.encode("utf-8")]


def _n_tokens(turns: list[dict]) -> int:
    """Tokens of ``_chatml(turns)``: per turn <|im_start|> role \\n content <|im_end|> \\n, then the opener."""
    per_turn = sum(len(t["role"].encode()) + len(t["content"].encode()) + 4 for t in turns)
    return per_turn + 1 + len(b"assistant\n")


def _dataset(
    data, tok, require_ground_truth: bool = False, prompt_key: str = "prompt", **kwargs
) -> RLDataset:
    rows, source = as_rows(data, prompt_key, **kwargs)
    return RLDataset(
        rows,
        tok,
        prompt_key=prompt_key,
        max_prompt_length=1024,
        source=source,
        require_ground_truth=require_ground_truth,
    )


def _notices(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_multi_turn_prompt_token_by_token(tok) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "sure"},
    ]
    ds = _dataset([{"messages": messages}], tok)
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    turn = lambda role, content: [start, *_bytes(f"{role}\n{content}"), end, *_bytes("\n")]  # noqa: E731
    expected = [
        *turn("system", "Be brief."),
        *turn("user", "hi"),
        *turn("assistant", "yo"),
        *turn("user", "ok?"),
        start,
        *_bytes("assistant\n"),
    ]
    assert ds[0]["input_ids"] == expected
    assert tok.decode(ds[0]["input_ids"]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ds[0]["extra_info"] == {"answer": "sure"} and ds[0]["ground_truth"] == "sure"


@pytest.mark.parametrize("form", FORMS)
def test_ultrachat_rows_keep_every_turn_up_to_the_last_user_turn(tok, caplog, form: str) -> None:
    rows = ultrachat_rows()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ds = _dataset(FORMS[form](rows), tok)
    assert len(ds) == len(rows) == 8
    for i, row in enumerate(rows):
        turns = row["messages"][:-1]  # ultrachat's conversations end with the assistant's answer
        roles = [m["role"] for m in ds[i]["raw_prompt"]]
        assert roles == ["user", "assistant"] * (len(turns) // 2) + ["user"]  # answers between the questions
        assert all((a, b) != ("user", "user") for a, b in itertools.pairwise(roles))
        assert ds[i]["raw_prompt"] == turns
        assert tok.decode(ds[i]["input_ids"]) == _chatml(turns)
        assert len(ds[i]["input_ids"]) == _n_tokens(turns)
        answer = row["messages"][-1]["content"]
        assert ds[i]["extra_info"] == {"answer": answer} and ds[i]["ground_truth"] == answer
        assert ds[i]["data_source"] == DEFAULT_SOURCE
    multi = [i for i, r in enumerate(rows) if len(r["messages"]) == 6]
    assert multi and [m["role"] for m in ds[multi[0]]["raw_prompt"]] == ["user", "assistant"] * 2 + ["user"]
    long = [i for i, r in enumerate(rows) if len(r["prompt"]) >= 444]
    assert long and all(len(ds[i]["input_ids"]) > 444 for i in long)  # whole first turns, nothing cut
    assert len(_notices(caplog, BOTH)) == 1  # once for the dataset, not once per row
    assert "8 of 8 rows" in _notices(caplog, BOTH)[0]
    assert len(_notices(caplog, "have a reference answer")) == 1


@pytest.mark.parametrize("form", FORMS)
def test_the_chinese_row(tok, form: str) -> None:
    ds = _dataset(FORMS[form](ultrachat_rows()[-1:]), tok)
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    expected = [start, *_bytes(f"user\n{CHINESE_PROMPT}"), end, *_bytes("\n"), start, *_bytes("assistant\n")]
    assert ds[0]["input_ids"] == expected
    assert (
        tok.decode(ds[0]["input_ids"])
        == f"<|im_start|>user\n{CHINESE_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ds[0]["ground_truth"] == ds[0]["extra_info"]["answer"] == CHINESE_ANSWER


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_ultrachat_files_give_the_same_prompts_on_the_command_line_as_from_python(
    tok, caplog, tmp_path: Path, suffix: str
) -> None:
    rows = ultrachat_rows()
    path = tmp_path / f"ultrachat{suffix}"
    save_rows(rows, path)
    python = _dataset(rows, tok)
    from_path = _dataset(str(path), tok)
    caplog.clear()  # the notices above (kept when an earlier test left hybridflow's logger at INFO)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        cli = build_rl_dataset(
            DataConfig(train_files=[str(path)], max_prompt_length=1024), tok, "train", seed=0
        )
    for ds in (cli, from_path):
        assert [it["input_ids"] for it in ds] == [it["input_ids"] for it in python]
        assert [it["extra_info"]["answer"] for it in ds] == [it["extra_info"]["answer"] for it in python]
    assert [_notices(caplog, BOTH)] == [
        [
            f"{path}: 8 of 8 rows {BOTH} (every turn up to the last user turn, "
            "chat-templated); drop the 'messages' column to use the 'prompt' text instead"
        ]
    ]


@pytest.mark.parametrize("form", FORMS)
def test_trl_prompt_only_and_prompt_completion_rows(tok, caplog, form: str) -> None:
    rows = trl_conversational_rows()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ds = _dataset(FORMS[form](rows), tok)
    for i, row in enumerate(rows):
        assert ds[i]["raw_prompt"] == row["prompt"]
        assert tok.decode(ds[i]["input_ids"]) == _chatml(row["prompt"])
        if "completion" in row:  # the completion is the reference answer
            answer = row["completion"][0]["content"]
            assert ds[i]["extra_info"]["answer"] == ds[i]["ground_truth"] == answer
        else:
            assert ds[i]["ground_truth"] is None and "answer" not in ds[i]["extra_info"]
    assert [m.split(": ", 1)[1] for m in _notices(caplog, "reference answer")] == [
        "3 of 6 rows have a reference answer (the last assistant turn after the prompt, or 'completion'): it is "
        "extra_info['answer'], and the ground truth of the 3 rows without one"
    ]


def test_trl_standard_prompt_completion_text(tok) -> None:
    ds = _dataset([{"prompt": "The sky is", "completion": " blue."}], tok)
    assert ds[0]["raw_prompt"] == "The sky is" and ds[0]["ground_truth"] == " blue."
    assert tok.decode(ds[0]["input_ids"]) == _chatml([{"role": "user", "content": "The sky is"}])


@pytest.mark.parametrize("form", FORMS)
def test_verl_rows_are_unchanged(tok, caplog, form: str) -> None:
    rows = verl_rows()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ds = _dataset(FORMS[form](rows), tok, require_ground_truth=True)
    assert not [r for r in caplog.records if r.name == "hybridflow.data.user_rows"]
    direct = RLDataset(rows, tok, max_prompt_length=1024)
    assert list(ds) == list(direct)
    assert ds[0]["extra_info"]["answer"] == rows[0]["extra_info"]["answer"]  # the row's own answer is kept


def test_a_chat_prompt_wins_over_messages_with_one_notice(tok, caplog) -> None:
    rows = [dict(r, messages=[*r["prompt"], {"role": "assistant", "content": "42"}]) for r in verl_rows()]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ds = _dataset(rows, tok, require_ground_truth=True)
    assert [it["raw_prompt"] for it in ds] == [r["prompt"] for r in rows]
    assert [it["ground_truth"] for it in ds] == [r["reward_model"]["ground_truth"] for r in rows]
    notices = _notices(caplog, "rows have both chat messages in 'prompt'")
    assert len(notices) == 1 and "'messages' is not used" in notices[0]


def test_messages_as_the_prompt_key(tok) -> None:
    rows = ultrachat_rows(3)
    ds = _dataset([{"messages": r["messages"]} for r in rows], tok, prompt_key="messages")
    assert [it["raw_prompt"] for it in ds] == [r["messages"][:-1] for r in rows]


def test_a_conversation_without_an_answer_and_a_tool_answer(tok) -> None:
    asked = [
        {"role": "user", "content": "a?"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c?"},
    ]
    tool = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "calling the tool"},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    ds = _dataset([{"messages": asked}, {"messages": tool}], tok)
    assert ds[0]["raw_prompt"] == asked and ds[0]["ground_truth"] is None and ds[0]["extra_info"] == {}
    assert ds[1]["raw_prompt"] == tool[:1] and ds[1]["ground_truth"] == "It is sunny."


def test_an_extra_info_answer_left_empty_by_parquet_takes_the_reference(tok, tmp_path: Path) -> None:
    rows = [dict(r, extra_info={"index": i, "answer": None}) for i, r in enumerate(ultrachat_rows(2))]
    rows[1]["extra_info"]["answer"] = "the row's own answer"
    save_rows(rows, tmp_path / "u.parquet")
    ds = _dataset(str(tmp_path / "u.parquet"), tok)
    assert ds[0]["extra_info"] == {"index": 0, "answer": rows[0]["messages"][-1]["content"]}
    assert ds[1]["extra_info"]["answer"] == "the row's own answer"
    assert ds[1]["ground_truth"] == rows[1]["messages"][-1]["content"]  # the ground truth is the reference


BAD_MESSAGES = {
    "a string": ("hello", r"column 'messages' must be a list of \{'role', 'content'\} turns, got str"),
    "empty": ([], "column 'messages' must be a list of .* got an empty list; fix the column"),
    "not turns": (["hi"], r"messages\[0\] must be a \{'role', 'content'\} turn, got 'hi'"),
    "no content": ([{"role": "user"}], r"messages\[0\] must be a \{'role', 'content'\} turn"),
    "unknown role": (
        [{"role": "human", "content": "hi"}],
        r"messages\[0\] has role 'human'; the roles are system, user, assistant, tool: rename it",
    ),
    "content None": (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
        r"messages\[1\]\['content'\] must be a str, got NoneType",
    ),
    "multimodal": (
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        r"messages\[0\]\['content'\] must be a str, got list .*multimodal",
    ),
    "no user turn": (
        [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
        r"column 'messages' has no user turn \(roles: system, assistant\); a prompt ends with a user turn",
    ),
    "system after the question": (
        [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}],
        r"messages\[1\] is a system turn after the last user turn; .*move it before the user turn",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_bad_messages_are_refused_naming_the_row(tok, case: str) -> None:
    messages, problem = BAD_MESSAGES[case]
    good = ultrachat_rows(1)[0]
    with pytest.raises(DataError, match=rf"^dataset: row 1: {problem}") as e:
        as_rows([good, {"prompt": "x", "messages": messages}])
    assert e.value.row == 1


def test_a_bad_conversation_in_a_file_names_the_file_and_line(tok, tmp_path: Path) -> None:
    rows = ultrachat_rows(3)
    rows[2]["messages"][0]["role"] = "bot"
    path = tmp_path / "train.jsonl"
    save_rows(rows, path)
    with pytest.raises(DataError, match=rf"^{path}: row 2 \(line 3\): messages\[0\] has role 'bot'"):
        build_rl_dataset(DataConfig(train_files=[str(path)], max_prompt_length=1024), tok, "train", seed=0)


def test_text_prompts_go_through_the_chat_template_unless_told(tok, caplog) -> None:
    rows = [{"prompt": "Why is the sky blue?"}, {"prompt": [{"role": "user", "content": "hi"}]}]
    rows = [dict(r, data_source="mine") for r in rows]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        templated = RLDataset(rows, tok, source="mine", require_ground_truth=False)
        raw = RLDataset(rows, tok, source="mine", require_ground_truth=False, template_text_prompts=False)
    assert tok.decode(templated[0]["input_ids"]) == _chatml(
        [{"role": "user", "content": "Why is the sky blue?"}]
    )
    assert templated[0]["raw_prompt"] == "Why is the sky blue?"
    assert raw[0]["input_ids"] == _bytes("Why is the sky blue?")
    assert raw[1]["input_ids"] == templated[1]["input_ids"]  # chat prompts are templated either way
    assert _notices(caplog, "1 of 2 prompts are text") == [
        "mine: 1 of 2 prompts are text: each is one user turn through the chat template, as verl does "
        "(data.template_text_prompts=false feeds them as they are)",
        "mine: 1 of 2 prompts are text and go to the model as they are, without the chat template "
        "(data.template_text_prompts=false)",
    ]
    bare = tok.__class__(tokenizer_object=tok.backend_tokenizer, pad_token=tok.pad_token)
    bare.chat_template = None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        plain = RLDataset(rows[:1], bare, require_ground_truth=False)
    assert plain[0]["input_ids"] == _bytes("Why is the sky blue?") and not _notices(
        caplog, "prompts are text"
    )


def _rewarded(data, tok, shape):
    """Score one made-up response per row as the trainer does: the notebook API's dataset, collated."""
    cfg = load_config(None, ["data.max_prompt_length=1024"])
    ds = build_dataset(cfg, data, tok, shape)
    batch = collate_prompts(list(ds), tok.pad_token_id)
    manager = RewardManager(shape.call, kind=shape.kind, fn_name=shape.name)
    texts = [f"response {i}" for i in range(len(ds))]
    scores, _ = manager.score(
        list(batch["data_source"]), texts, list(batch["ground_truth"]), list(batch["extra_info"])
    )
    return scores


@pytest.mark.parametrize("form", FORMS)
def test_reward_functions_receive_the_reference_answer(tok, form: str) -> None:
    rows = ultrachat_rows(4)
    answers = [r["messages"][-1]["content"] for r in rows]
    seen: dict[str, list] = {"truths": [], "infos": []}

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        seen["truths"].append(ground_truth)
        seen["infos"].append(extra_info)
        return 1.0

    def trl(completions, prompts, answer, ground_truth, messages, prompt_id, **kwargs):
        seen.update(completions=completions, prompts=prompts, answer=answer, gt=ground_truth, ids=prompt_id)
        return [0.5] * len(completions)

    assert _rewarded(FORMS[form](rows), tok, recognise_reward(verl)) == [1.0] * 4
    assert seen["truths"] == answers and [i["answer"] for i in seen["infos"]] == answers
    assert _rewarded(FORMS[form](rows), tok, recognise_reward(trl)) == [0.5] * 4
    assert seen["answer"] == seen["gt"] == answers and seen["ids"] == [r["prompt_id"] for r in rows]
    assert seen["prompts"] == [r["messages"][:-1] for r in rows]  # the conversation, as TRL gives it
    assert seen["completions"][0] == [{"role": "assistant", "content": "response 0"}]


def test_sft_on_an_ultrachat_file_learns_the_last_answer_after_its_conversation(tok, tmp_path: Path) -> None:
    rows = ultrachat_rows(3)
    save_rows(rows, tmp_path / "u.jsonl")
    loaded = load_split_rows(DataConfig(train_files=[str(tmp_path / "u.jsonl")]), "train", seed=0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts, responses, masks, _ = encode_pairs(tok, loaded, end)
    assert all(m == [1] * len(r) for r, m in zip(responses, masks))  # no tool turns: the whole answer
    for row, prompt, response in zip(rows, prompts, responses):
        assert tok.decode(prompt) == _chatml(row["messages"][:-1])
        assert tok.decode(response) == row["messages"][-1]["content"] + "<|im_end|>"
