"""load_tokenizer: missing tokenizer files, the class tokenizer_config.json names, empty tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybridflow.models import build_tiny_model, build_tiny_model_and_tokenizer, load_tokenizer

WORDS = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, "hello": 3, "world": 4, "apples": 5, "pears": 6}


def word_level_tokenizer(vocab: dict[str, int] = WORDS) -> PreTrainedTokenizerFast:
    """A WordLevel (whole words, whitespace-split) tokenizer: no merges, no byte-level symbols."""
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )


def qwen2_dir(path: Path) -> Path:
    """A directory whose config.json says qwen2: the case where transformers 5 picks Qwen2Tokenizer."""
    build_tiny_model("qwen2", vocab_size=16, hidden_size=16, num_hidden_layers=1).save_pretrained(path)
    return path


def test_model_dir_without_tokenizer_files_names_them(tmp_path: Path) -> None:
    qwen2_dir(tmp_path)
    with pytest.raises(ValueError) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    for name in (str(tmp_path), "tokenizer.json", "tokenizer_config.json", "model.tokenizer_path"):
        assert name in message
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(tmp_path, fix_option="--tokenizer")


def test_tokenizer_config_without_a_vocabulary_names_the_missing_files(tmp_path: Path) -> None:
    qwen2_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    with pytest.raises(ValueError, match=r"no vocabulary.*tokenizer\.json.*vocab\.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("with_tokenizer_config", [True, False])
def test_word_level_tokenizer_next_to_a_qwen2_config_keeps_its_vocabulary(
    tmp_path: Path, with_tokenizer_config: bool
) -> None:
    saved = word_level_tokenizer()
    saved.save_pretrained(qwen2_dir(tmp_path))
    if not with_tokenizer_config:  # a bare tokenizer.json: PreTrainedTokenizerFast as well
        (tmp_path / "tokenizer_config.json").unlink()
    loaded = load_tokenizer(tmp_path, **({} if with_tokenizer_config else {"pad_token": "[PAD]"}))
    assert isinstance(loaded, PreTrainedTokenizerFast)
    text = "hello world apples and pears"
    assert loaded.encode(text) == saved.encode(text) == [3, 4, 5, 0, 6]
    assert loaded.pad_token == "[PAD]"


def test_tokenizer_that_turns_text_into_no_tokens_is_refused_with_its_class(tmp_path: Path) -> None:
    word_level_tokenizer().save_pretrained(qwen2_dir(tmp_path))
    config = tmp_path / "tokenizer_config.json"
    # Naming Qwen2Tokenizer rebuilds the words as a byte-level BPE that has no symbol for any single char.
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "Qwen2Tokenizer"}))
    with pytest.raises(ValueError) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    assert "Qwen2Tokenizer" in message and str(tmp_path) in message and "no tokens" in message
    assert '"tokenizer_class": "PreTrainedTokenizerFast"' in message


def test_a_small_domain_vocabulary_without_letters_still_loads(tmp_path: Path) -> None:
    # Digits and operators only, no unknown token: letters vanish, digits do not. Not an empty tokenizer.
    vocab = {ch: i for i, ch in enumerate("0123456789+-*/=")} | {"[PAD]": 15, "[EOS]": 16}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]")
    tok.save_pretrained(qwen2_dir(tmp_path))
    assert load_tokenizer(tmp_path).encode("12+3") == [1, 2, 10, 3]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_char_tokenizer_loads_back_with_the_same_ids_and_template(tmp_path: Path, arch: str) -> None:
    _, saved = build_tiny_model_and_tokenizer(tmp_path, arch=arch, hidden_size=16, num_hidden_layers=1)
    loaded = load_tokenizer(tmp_path)
    text = "Solve 12 + 7 = ? <|im_end|> é"
    assert loaded.encode(text) == saved.encode(text)
    assert loaded.decode(saved.encode(text)) == text
    chat = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(chat, tokenize=False) == saved.apply_chat_template(chat, tokenize=False)
    assert (loaded.pad_token_id, loaded.eos_token_id) == (saved.pad_token_id, saved.eos_token_id)
