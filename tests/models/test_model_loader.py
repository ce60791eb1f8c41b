"""Local loaders: path checks, dtype, attention choice, override_config, pad-token default."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridflow.models import build_char_tokenizer, load_causal_lm, load_tokenizer, resolve_dtype


def test_missing_directory_raises(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="no such directory") as err:
        load_causal_lm(missing)
    assert str(missing) in str(err.value) and "hub" not in str(err.value)
    with pytest.raises(ValueError, match="no such directory"):
        load_tokenizer(missing)
    with pytest.raises(ValueError, match=r"no such directory; .* local directories only: download it first"):
        load_causal_lm("Qwen/Qwen2.5-0.5B")  # a hub id is not fetched, and the message says how to get it


def test_file_instead_of_directory_raises(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        load_causal_lm(file)


def test_directory_without_config_raises(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"config\.json") as err:
        load_causal_lm(tmp_path)
    assert str(tmp_path) in str(err.value)
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(tmp_path)


def test_resolve_dtype():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("float16") is torch.float16
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_dtype("float8")
    with pytest.raises(ValueError, match="floating-point"):
        resolve_dtype(torch.int64)
    with pytest.raises(TypeError):
        resolve_dtype(32)


def test_bad_dtype_raises_before_loading(tiny_dir):
    _, path = tiny_dir
    with pytest.raises(ValueError, match="'float32'"):
        load_causal_lm(path, dtype="half-precision")


def test_dtype_and_attention_choice(tiny_dir):
    _, path = tiny_dir
    model = load_causal_lm(path, dtype="bfloat16", attn_implementation="eager")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.config._attn_implementation == "eager"
    sdpa = load_causal_lm(path, attn_implementation="sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
    ids = torch.tensor([[3, 10, 11, 12, 13, 14]])
    eager = load_causal_lm(path, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(eager(input_ids=ids).logits, sdpa(input_ids=ids).logits)


def test_bad_override_key_raises(tiny_dir):
    _, path = tiny_dir
    with pytest.raises(ValueError, match="attention_dropuot"):
        load_causal_lm(path, override_config={"attention_dropuot": 0.1})


def test_override_config_applied(tiny_dir):
    _, path = tiny_dir
    ids = torch.tensor([[3, 10, 11, 12, 13, 14, 15, 16]])
    base = load_causal_lm(path)
    model = load_causal_lm(path, override_config={"attention_dropout": 0.25, "rope_theta": 50.0})
    assert model.config.attention_dropout == 0.25
    assert model.config.rope_parameters["rope_theta"] == 50.0
    # Same weights, different rotary base: logits past the first position must change.
    for p, q in zip(base.parameters(), model.parameters()):
        assert torch.equal(p, q)
    with torch.no_grad():
        a, b = base(input_ids=ids).logits, model(input_ids=ids).logits
    torch.testing.assert_close(a[:, 0], b[:, 0])
    assert not torch.allclose(a[:, 1:], b[:, 1:])
    # A dict merges into the rope_parameters dict instead of replacing it.
    merged = load_causal_lm(path, override_config={"rope_parameters": {"rope_theta": 70.0}})
    assert merged.config.rope_parameters["rope_theta"] == 70.0
    assert merged.config.rope_parameters["rope_type"] == "default"


def _save_tokenizer_without_pad(path, keep_eos=True):
    tok = build_char_tokenizer()
    tok.pad_token = None
    if not keep_eos:
        tok.eos_token = None
    tok.save_pretrained(path)
    return tok


def test_pad_token_defaults_to_eos_logged_once(tmp_path, caplog):
    _save_tokenizer_without_pad(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hybridflow.models"):
        first = load_tokenizer(tmp_path)
        second = load_tokenizer(tmp_path)
    assert first.pad_token == "<|endoftext|>"
    assert first.pad_token_id == first.eos_token_id
    assert second.pad_token_id == second.eos_token_id
    pad_records = [r for r in caplog.records if "pad" in r.getMessage()]
    assert len(pad_records) == 1


def test_existing_pad_token_is_kept(tiny_dir):
    _, path = tiny_dir
    tok = load_tokenizer(path)
    assert tok.pad_token == "<|pad|>"
    assert tok.pad_token_id != tok.eos_token_id


def test_tokenizer_without_pad_or_eos_raises(tmp_path):
    _save_tokenizer_without_pad(tmp_path, keep_eos=False)
    with pytest.raises(ValueError, match="pad_token="):
        load_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path, pad_token="<|pad|>").pad_token == "<|pad|>"
