"""`hybridflow generate` on a tiny model saved to disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import cli_cases

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.utils.errors import UserError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    build_tiny_model_and_tokenizer(out_dir=out, arch="qwen2")
    return out


def write_prompts(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) if not isinstance(r, str) else r for r in rows) + "\n")
    return path


def generate_argv(model: Path, prompts: Path, out: Path | str, *extra: str) -> list[str]:
    """The ``hybridflow generate`` arguments for ``model``, ``prompts`` and ``out``, then ``extra``."""
    return ["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out), *extra]


def test_generate_writes_one_line_per_sample(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [
            {"prompt": "12+7="},
            {"prompt": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "user", "content": "3*4"}]},
        ],
    )
    out = tmp_path / "out" / "gen.jsonl"
    code = main(
        generate_argv(
            model_dir, prompts, out, "--n", "2", "--max-new-tokens", "5", "--seed", "1", "--ignore-eos"
        )
    )
    assert code == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in lines] == [
        (i, s) for i in range(3) for s in range(2)
    ]
    for r in lines:
        assert len(r["token_ids"]) == len(r["logprobs"]) == 5
        assert r["finish_reason"] == "length"
        assert all(lp <= 0 for lp in r["logprobs"])
        assert isinstance(r["text"], str)
    assert "tokens/s" in capsys.readouterr().out


def _swept(env: cli_cases.Env, rows: list, extra: list, message: str) -> tuple[list[str], str]:
    """One case of the test below as the reliability sweep runs it (on the sweep's own tiny model)."""
    return env.generate(env.model, write_prompts(env.tmp / "p.jsonl", rows), *extra), message


@cli_cases.sweep(_swept)
@pytest.mark.parametrize(
    "rows,extra,message",
    [
        (["{not json"], [], "p.jsonl:1: not valid JSON"),
        ([{"prompt": ""}], [], "p.jsonl:1: the prompt is empty"),
        ([{"text": "x"}], [], 'p.jsonl:1: expected an object with "prompt"'),
        (
            [{"messages": [{"role": "assistant", "content": "x"}]}],
            [],
            "p.jsonl: row 0 (line 1): column 'messages' has no user turn",
        ),
        ([{"prompt": "x"}], ["--n", "0"], "n"),
        ([{"prompt": "x"}], ["--device", "tpu"], "--device: unknown value 'tpu'"),
        pytest.param(
            [{"prompt": "x"}],
            ["--device", "cuda"],
            "--device cuda, but this process sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU"),
        ),
    ],
)
def test_bad_inputs_exit_2_with_the_row(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, rows: list, extra: list, message: str
) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    code = main(generate_argv(model_dir, prompts, tmp_path / "o.jsonl", *extra))
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unknown_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "x"}])
    code = main(generate_argv(tmp_path / "nope", prompts, "o.jsonl"))
    assert code == 2
    assert "nope" in capsys.readouterr().err


def test_a_prompt_plus_max_new_tokens_past_the_position_limit_is_warned_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    model = tmp_path / "short"
    build_tiny_model_and_tokenizer(
        out_dir=model, hidden_size=32, num_hidden_layers=1, max_position_embeddings=16
    )
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "12+7="}])  # 5 tokens
    out = tmp_path / "gen.jsonl"
    assert main(generate_argv(model, prompts, out, "--max-new-tokens", "20", "--ignore-eos")) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "position limit" in line]
    assert len(warning) == 1 and "WARNING" in warning[0]
    assert "the longest prompt (5 tokens) + --max-new-tokens 20 = 25 tokens" in warning[0]
    assert "max_position_embeddings=16" in warning[0] and "lower --max-new-tokens to 11" in warning[0]
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(line["token_ids"]) == 11  # capped where the positions end, as the warning says


def test_a_conversation_prompts_as_in_training(tmp_path: Path) -> None:
    from support.chat_rows import ultrachat_rows

    from hybridflow.cli.generate_cmd import read_prompts
    from hybridflow.data import RLDataset
    from hybridflow.data.user_rows import as_rows
    from hybridflow.models import build_char_tokenizer

    tok = build_char_tokenizer()
    rows = ultrachat_rows(4)
    ids = read_prompts(str(write_prompts(tmp_path / "p.jsonl", rows)), tok)
    trained = RLDataset(as_rows(rows)[0], tok, max_prompt_length=1024, require_ground_truth=False)
    assert ids == [it["input_ids"] for it in trained]  # up to the last user turn, no answer in the prompt
    last_question = rows[2]["messages"][-2]["content"]  # the answer after it is not in the prompt
    assert tok.decode(ids[2]).endswith(
        f"<|im_start|>user\n{last_question}<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(UserError, match=r"p\.jsonl: row 0 \(line 1\): column 'messages' has no user turn"):
        read_prompts(
            str(write_prompts(tmp_path / "p.jsonl", [{"messages": [{"role": "system", "content": "s"}]}])),
            tok,
        )


@pytest.mark.parametrize("arch,engine", [("gpt2", "native"), ("gpt2", "hf"), ("qwen2", "hf")])
def test_responses_stop_at_the_position_limit_on_hf_generate_too(
    tmp_path: Path, capsys: pytest.CaptureFixture, arch: str, engine: str
) -> None:
    # The case: a 256-position GPT-2 warned that responses stop at 252 tokens, then died with an
    # IndexError (the HF fallback ran past its last position). Several prompts, of very different lengths.
    model = tmp_path / arch
    build_tiny_model_and_tokenizer(
        out_dir=model, arch=arch, hidden_size=32, num_hidden_layers=1, max_position_embeddings=256
    )
    rows = [
        {"prompt": "a" * 252},
        {"prompt": "12+7="},
        {"messages": [{"role": "user", "content": "b" * 120}]},
    ]
    rows.append({"prompt": "c" * 249})
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    out = tmp_path / "gen.jsonl"
    argv = generate_argv(model, prompts, out, "--max-new-tokens", "8", "--n", "2", "--seed", "3")
    assert main([*argv, "--ignore-eos", "--engine", engine]) == 0
    err = capsys.readouterr().err
    assert "its responses stop at 4 tokens" in err
    fallback = [line for line in err.splitlines() if "HF generate" in line]
    assert len(fallback) == (1 if (arch, engine) == ("gpt2", "native") else 0)  # asked for: no warning
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    lengths = [len(r["token_ids"]) for r in lines]
    assert lengths == [4, 4, 8, 8, 8, 8, 7, 7]  # 256 - 252, then whole, then 256 - 249
    assert all(r["finish_reason"] == "length" and len(r["logprobs"]) == len(r["token_ids"]) for r in lines)
