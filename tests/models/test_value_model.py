"""Critic: backbone from a causal LM, fresh deterministic head, (B, T) values, save/reload."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hybridflow.models import (
    build_tiny_model,
    build_value_model,
    compute_values,
    load_causal_lm,
    load_value_model,
    value_head,
)

IDS = torch.tensor([[5, 9, 40, 41, 2, 0], [7, 8, 9, 10, 11, 12]])  # (B=2, T=6)
MASK = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])


def test_value_model_from_causal_lm_dir(tiny_dir):
    _, path = tiny_dir
    lm = load_causal_lm(path)
    critic = load_value_model(path)
    critic_state = critic.state_dict()
    lm_state = lm.state_dict()
    backbone_keys = [k for k in lm_state if k.startswith("model.")]
    assert backbone_keys
    for key in backbone_keys:
        assert torch.equal(critic_state[key], lm_state[key]), key
    assert not any(k.startswith("lm_head") for k in critic_state)

    head = value_head(critic)
    hidden = lm.config.hidden_size
    assert head.weight.shape == (1, hidden)
    assert torch.count_nonzero(head.bias) == 0
    # Fresh head: small (std 1/(H+1)) but not zero, the same on every load, different for another seed.
    assert 0.3 / (hidden + 1) < head.weight.std().item() < 3.0 / (hidden + 1)
    assert torch.equal(value_head(load_value_model(path)).weight, head.weight)
    assert not torch.equal(value_head(load_value_model(path, head_seed=1)).weight, head.weight)


def test_values_are_head_of_backbone_hidden_states(tiny_dir):
    _, path = tiny_dir
    lm = load_causal_lm(path)
    critic = load_value_model(path)
    values = compute_values(critic, IDS, attention_mask=MASK)
    assert values.shape == (2, 6)
    assert values.dtype == torch.float32
    head = value_head(critic)
    with torch.no_grad():
        hidden = lm.model(input_ids=IDS, attention_mask=MASK).last_hidden_state  # (B, T, H)
    expected = torch.zeros(2, 6)
    for b in range(2):
        for t in range(6):
            expected[b, t] = (hidden[b, t] * head.weight[0]).sum() + head.bias[0]
    torch.testing.assert_close(values.detach(), expected)


def test_value_head_has_no_dropout_and_backbone_gets_gradient(tiny_dir):
    _, path = tiny_dir
    critic = load_value_model(path).train()
    first = compute_values(critic, IDS, MASK)
    second = compute_values(critic, IDS, MASK)
    assert torch.equal(first, second)
    first.sum().backward()
    assert critic.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
    assert value_head(critic).weight.grad.abs().sum() > 0


def test_value_model_bf16(tiny_dir):
    _, path = tiny_dir
    critic = load_value_model(path, dtype="bf16")
    assert value_head(critic).weight.dtype == torch.bfloat16
    assert compute_values(critic, IDS, MASK).dtype == torch.float32


def test_saved_critic_reloads_with_its_head(tiny_dir, tmp_path):
    _, path = tiny_dir
    critic = load_value_model(path)
    with torch.no_grad():
        value_head(critic).weight.fill_(0.5)  # not what a fresh init would give
        value_head(critic).bias.fill_(-1.0)
    critic.save_pretrained(tmp_path)
    reloaded = load_value_model(tmp_path)
    assert torch.equal(value_head(reloaded).weight, torch.full_like(value_head(reloaded).weight, 0.5))
    assert value_head(reloaded).bias.item() == -1.0
    with torch.no_grad():
        torch.testing.assert_close(compute_values(reloaded, IDS, MASK), compute_values(critic, IDS, MASK))


def test_build_value_model_matches_loaded(tiny_dir):
    _, path = tiny_dir
    lm = load_causal_lm(path)
    in_memory = build_value_model(lm)
    loaded = load_value_model(path)
    for (name, p), q in zip(loaded.named_parameters(), in_memory.parameters()):
        assert torch.equal(p, q), name
    # The critic owns a copy: training it must not move the policy's weights.
    assert in_memory.model.embed_tokens.weight.data_ptr() != lm.model.embed_tokens.weight.data_ptr()


def test_checkpoint_without_backbone_weights_raises(tmp_path):
    lm = build_tiny_model("llama")
    lm.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in lm.state_dict().items() if ".layers.1." not in k}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\."):
        load_value_model(tmp_path)


def test_compute_values_rejects_bad_input(tiny_dir):
    _, path = tiny_dir
    critic = load_value_model(path)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        compute_values(critic, IDS[0])
    with pytest.raises(ValueError, match="load_value_model"):
        compute_values(load_causal_lm(path), IDS)
    with pytest.raises(TypeError, match="scalar"):
        value_head(load_causal_lm(path))


@pytest.mark.parametrize("arch", ["gpt2", "mixtral"])
def test_critics_of_the_other_families(tmp_path, arch):
    # GPT-2's token-classification head is ``classifier``, not ``score``: the critic of a GPT-2 policy used
    # to fail at start. From a saved causal LM (fresh head) and from one in memory, the same critic.
    lm = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=1)
    lm.save_pretrained(tmp_path)
    loaded, built = load_value_model(tmp_path), build_value_model(lm)
    for critic in (loaded, built):
        head = value_head(critic)
        assert head.out_features == 1 and head.in_features == 32
    assert torch.equal(value_head(loaded).weight, value_head(built).weight)  # the same deterministic head
    values = compute_values(loaded.eval(), IDS, MASK)
    assert values.shape == (2, 6) and torch.equal(values, compute_values(built.eval(), IDS, MASK))
