"""utils/text.batch_decode gives transformers' text, through the Rust backend where that is the same."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hybridflow.models.tiny import build_char_tokenizer
from hybridflow.utils.text import batch_decode

CORPUS = ["The answer is 42.", "Let's think step by step: 6 * 7 = 42 !", "héllo wörld , ok ?"] * 20


def bpe_tokenizer(clean_up: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on a tiny corpus, with special tokens, as Qwen's is built."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"])
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", clean_up_tokenization_spaces=clean_up
    )


def wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """WordPiece, where transformers' clean-up of spaces before punctuation does change the text."""
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(cleanup=False)  # the clean-up is left to transformers
    backend.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", ["char", "bpe", "bpe_clean_up", "wordpiece"])
def test_same_text_as_transformers(name: str, skip: bool) -> None:
    tokenizer = {
        "char": build_char_tokenizer,
        "bpe": lambda: bpe_tokenizer(False),
        "bpe_clean_up": lambda: bpe_tokenizer(True),
        "wordpiece": wordpiece_tokenizer,
    }[name]()
    rows = [tokenizer(text)["input_ids"] for text in CORPUS[:3]]
    special = [i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None]
    rows = [rows[0] + special, special + rows[1], rows[2], []]
    got = batch_decode(tokenizer, rows, skip_special_tokens=skip)
    assert got == tokenizer.batch_decode(rows, skip_special_tokens=skip)
    assert got[0].startswith("The answer is") or name in ("char", "wordpiece")  # a real text came back


def test_the_clean_up_changes_wordpiece_text_so_it_is_not_skipped() -> None:
    tokenizer = wordpiece_tokenizer()
    ids = tokenizer("wörld , ok ?")["input_ids"]
    assert tokenizer.backend_tokenizer.decode(ids) != tokenizer.decode(ids)  # the clean-up does something
    assert batch_decode(tokenizer, [ids]) == [tokenizer.decode(ids)]
