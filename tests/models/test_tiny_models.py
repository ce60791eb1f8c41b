"""Tiny-model factory and the char tokenizer."""

from __future__ import annotations

import string

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM, Qwen2ForCausalLM

from hybridflow.models import (
    build_char_tokenizer,
    build_tiny_model,
    build_tiny_model_and_tokenizer,
    load_causal_lm,
    load_tokenizer,
)

TEXT = "Hello, World!\n  x = 3*(4+5) - 2/7;\t'q' \"r\" {a: [b]} ~`^|\\_@#$%&<>? a , b . c ' d"


@pytest.mark.parametrize(("arch", "cls"), [("qwen2", Qwen2ForCausalLM), ("llama", LlamaForCausalLM)])
def test_build_tiny_model_config_and_forward(arch, cls):
    model = build_tiny_model(
        arch, vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=2
    )
    assert isinstance(model, cls)
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (50, 32, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (4, 2, 512)
    assert cfg.intermediate_size == 128
    logits = model(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]])).logits
    assert logits.shape == (2, 3, 50)
    assert torch.isfinite(logits).all()


def test_tied_embeddings_default_per_arch():
    qwen = build_tiny_model("qwen2")
    llama = build_tiny_model("llama")
    assert qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
    assert llama.lm_head.weight.data_ptr() != llama.model.embed_tokens.weight.data_ptr()
    untied = build_tiny_model("qwen2", tie_word_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_seed_determinism_and_global_rng_untouched():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model("llama", seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # the factory did not consume the global stream
    b = build_tiny_model("llama", seed=7)
    c = build_tiny_model("llama", seed=8)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_bf16_model_is_cast_of_fp32_weights():
    fp32 = build_tiny_model("qwen2", seed=3)
    bf16 = build_tiny_model("qwen2", seed=3, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert torch.equal(bf16.model.embed_tokens.weight, fp32.model.embed_tokens.weight.to(torch.bfloat16))


def test_bad_arch_and_head_split():
    with pytest.raises(ValueError, match="qwen2"):
        build_tiny_model("bloom")
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=3)


def test_char_tokenizer_one_token_per_char_round_trip():
    tok = build_char_tokenizer()
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT)
    assert [tok.decode([i]) for i in ids] == list(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.unk_token_id not in ids
    every_char = string.digits + string.ascii_letters + string.punctuation + " \n"
    assert tok.decode(tok.encode(every_char)) == every_char
    assert len(set(tok.encode(every_char))) == len(every_char)


def test_char_tokenizer_special_tokens():
    tok = build_char_tokenizer()
    specials = ["<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
    ids = [tok.convert_tokens_to_ids(s) for s in specials]
    assert len(set(ids)) == 6
    assert [tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token] == [
        "<|pad|>",
        "<|bos|>",
        "<|endoftext|>",
        "<|unk|>",
    ]
    # A special token inside text is one token, never split into chars; no bos/eos is added implicitly.
    encoded = tok.encode("<|im_start|>ab<|im_end|>")
    assert encoded == [ids[3], tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b"), ids[4]]
    assert tok.decode(encoded, skip_special_tokens=True) == "ab"


def test_non_ascii_falls_back_to_bytes():
    tok = build_char_tokenizer()
    text = "café 日本 ü"
    ids = tok.encode(text)
    # One token per UTF-8 byte outside ASCII: "caf" 3, "é" 2, " " 1, "日本" 6, " " 1, "ü" 2.
    assert len(ids) == 3 + 2 + 1 + 6 + 1 + 2
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids


def test_extra_chars_extend_vocab():
    base = build_char_tokenizer()
    tok = build_char_tokenizer(extra_chars="éa→é")  # "a" is ASCII, the second "é" a repeat
    # "é" (2 bytes) adds its own token; "→" (3 bytes) adds its 2-byte prefix and itself.
    assert len(tok) == len(base) + 3
    assert len(tok.encode("café → x")) == len("café → x")
    assert tok.decode(tok.encode("café → x")) == "café → x"
    assert tok.encode("abc") == base.encode("abc")


def test_chat_template_qwen_style():
    tok = build_char_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == expected.removesuffix("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tok.encode(expected)


def test_model_and_tokenizer_ids_match(tmp_path):
    model, tok = build_tiny_model_and_tokenizer(tmp_path, arch="llama", extra_chars="é")
    assert model.config.vocab_size == len(tok)
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.bos_token_id == tok.bos_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    gen = GenerationConfig.from_pretrained(tmp_path)
    assert gen.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    assert gen.pad_token_id == tok.pad_token_id
    with pytest.raises(TypeError, match="vocab_size"):
        build_tiny_model_and_tokenizer(arch="llama", vocab_size=10)


def test_model_round_trip_same_logits(tiny_dir):
    arch, path = tiny_dir
    original, _ = build_tiny_model_and_tokenizer(arch=arch, seed=1)
    reloaded = load_causal_lm(path)
    assert type(reloaded) is type(original)
    ids = torch.tensor([[5, 9, 40, 41, 2], [7, 7, 7, 3, 4]])
    with torch.no_grad():
        assert torch.equal(original(input_ids=ids).logits, reloaded(input_ids=ids).logits)


def test_tokenizer_round_trip(tiny_dir):
    _, path = tiny_dir
    original = build_char_tokenizer()
    for reloaded in (load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)):
        assert reloaded.encode(TEXT) == original.encode(TEXT)
        assert reloaded.decode(original.encode(TEXT)) == TEXT
        assert reloaded.chat_template == original.chat_template
        assert (reloaded.pad_token_id, reloaded.eos_token_id, reloaded.bos_token_id) == (
            original.pad_token_id,
            original.eos_token_id,
            original.bos_token_id,
        )
        messages = [{"role": "user", "content": "hi"}]
        assert reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        )
