"""The shared MoE routing and grouped experts against transformers' own blocks and a loop over experts."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from hybridflow.models.moe import (
    MoEBlock,
    grouped_experts,
    install_moe,
    keep_records,
    load_balancing_loss,
    loop_experts,
    moe_blocks,
    records,
    route,
    router_spec,
    run_experts,
    set_replay,
)
from hybridflow.models.tiny import build_tiny_model
from hybridflow.utils.errors import UserError

MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral")


def _tiny_deepseek() -> torch.nn.Module:
    config = DeepseekV3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        routed_scaling_factor=2.5,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).eval()


def _model(arch: str) -> torch.nn.Module:
    model = _tiny_deepseek() if arch == "deepseek_v3" else build_tiny_model(arch, num_hidden_layers=2, seed=1)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(2)
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):  # routers start at zero in some families: make choices differ
                p.normal_(0, 0.5)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    return model


def _batch(vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (3, 11), generator=gen)


@pytest.mark.parametrize("arch", [*MOE_ARCHS, "deepseek_v3"])
def test_moe_block_equals_hf_values_and_grads(arch: str) -> None:
    hf = _model(arch)
    ours = copy.deepcopy(hf)
    assert install_moe(ours) == 2 and len(moe_blocks(ours)) == 2
    assert [n for n, _ in hf.named_parameters()] == [n for n, _ in ours.named_parameters()]
    ids = _batch(hf.config.vocab_size)
    out_hf, out_ours = hf(ids).logits, ours(ids).logits
    torch.testing.assert_close(out_ours, out_hf, atol=1e-5, rtol=1e-5)
    out_hf.square().mean().backward()
    out_ours.square().mean().backward()
    for (name, a), b in zip(hf.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_grouped_equals_loop_values_and_grads_with_empty_experts() -> None:
    gen = torch.Generator().manual_seed(0)
    n, h, inter, e, k = 13, 16, 8, 6, 2
    x = torch.randn(n, h, generator=gen, requires_grad=True)
    gate_up = torch.randn(e, 2 * inter, h, generator=gen, requires_grad=True)
    down = torch.randn(e, h, inter, generator=gen, requires_grad=True)
    ids = torch.randint(0, 3, (n, k), generator=gen)  # experts 3-5 receive no token
    ids[:, 1] = (ids[:, 0] + 1) % 3
    weights = torch.rand(n, k, generator=gen, requires_grad=True)
    outs, grads = [], []
    for fn in (grouped_experts, loop_experts):
        y = fn(x, ids, weights, gate_up, down)
        y.sum().backward()  # a stride-0 gradient: grouped_mm's CPU backward needs it made contiguous
        outs.append(y.detach())
        grads.append([t.grad.clone() for t in (x, gate_up, down, weights)])
        for t in (x, gate_up, down, weights):
            t.grad = None
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert grads[0][1][3:].abs().sum() == 0  # empty experts get no gradient


def test_grouped_bf16_close_to_float32() -> None:
    gen = torch.Generator().manual_seed(1)
    x, gate_up, down = (
        torch.randn(9, 16, generator=gen),
        torch.randn(4, 16, 16, generator=gen),
        torch.randn(4, 16, 8, generator=gen),
    )
    ids = torch.stack([torch.arange(9) % 4, (torch.arange(9) + 1) % 4], 1)
    w = torch.rand(9, 2, generator=gen)
    ref = loop_experts(x, ids, w, gate_up, down)
    got = grouped_experts(x.bfloat16(), ids, w.bfloat16(), gate_up.bfloat16(), down.bfloat16()).float()
    torch.testing.assert_close(got, ref, atol=0.1 * ref.abs().max().item(), rtol=0.05)


def test_replay_fixes_experts_and_router_still_learns() -> None:
    model = _model("qwen3_moe")
    install_moe(model)
    ids = _batch(model.config.vocab_size)
    keep_records(model, True)
    base = model(ids).logits.detach()
    chosen = torch.stack([r.ids for r in records(model)], 1)  # (N, L, k)
    # A perturbed router chooses other experts; replaying the recorded ones gives the original experts back.
    with torch.no_grad():
        for block in moe_blocks(model):
            block.gate.weight.add_(torch.randn_like(block.gate.weight))
    model(ids)
    moved = torch.stack([r.ids for r in records(model)], 1)
    assert not torch.equal(moved.sort(-1)[0], chosen.sort(-1)[0])
    set_replay(model, chosen)
    out = model(ids).logits
    replayed = torch.stack([r.ids for r in records(model)], 1)
    assert torch.equal(replayed, chosen)
    assert not torch.allclose(out, base)  # the weights come from the new scores
    out.square().mean().backward()
    assert all(b.gate.weight.grad.abs().sum() > 0 for b in moe_blocks(model))
    set_replay(model, None)
    assert all(b.replay is None for b in moe_blocks(model))
    with pytest.raises(ValueError, match="MoE layers"):
        set_replay(model, chosen[:, :1])


def test_route_replay_weights_from_scores() -> None:
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(4))
    spec = router_spec(build_tiny_model("mixtral", num_hidden_layers=1).config)
    w, ids = route(logits, spec)
    w2, replayed = route(logits, spec, replay=ids.flip(-1))
    assert torch.equal(replayed, ids.flip(-1))
    torch.testing.assert_close(w2, w.flip(-1))
    assert w.dtype == torch.float32 and torch.allclose(w.sum(-1), torch.ones(5))


def test_load_balancing_loss_equals_transformers() -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    gen = torch.Generator().manual_seed(5)
    logits = [torch.randn(2 * 7, 4, generator=gen) for _ in range(3)]
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    ref = load_balancing_loss_func(tuple(logits), 4, 2, mask)
    torch.testing.assert_close(load_balancing_loss(logits, 2, mask.reshape(-1)), ref)
    torch.testing.assert_close(load_balancing_loss(logits, 2), load_balancing_loss_func(tuple(logits), 4, 2))


def test_dense_and_unknown_families() -> None:
    assert router_spec(build_tiny_model("qwen2").config) is None
    config = build_tiny_model("mixtral", num_hidden_layers=1).config
    config.model_type = "jamba"
    with pytest.raises(UserError, match="jamba"):
        router_spec(config)
    assert isinstance(MoEBlock, type)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_on_the_gpu_equals_the_loop_in_bf16() -> None:
    # SM90 runs F.grouped_mm in bf16; elsewhere run_experts falls back to the loop (also checked here).
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, h, inter, e, k = 70, 256, 128, 16, 4
    x = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
    gate_up = (torch.randn(e, 2 * inter, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    down = (torch.randn(e, h, inter, device="cuda", generator=gen) / inter**0.5).bfloat16()
    ids = torch.stack([torch.randperm(e - 3, device="cuda", generator=gen)[:k] for _ in range(n)])
    weights = torch.rand(n, k, device="cuda", generator=gen).bfloat16()
    ref = loop_experts(x.float(), ids, weights.float(), gate_up.float(), down.float())
    for fn in (run_experts, loop_experts):
        got = fn(x, ids, weights, gate_up, down).float()
        torch.testing.assert_close(got, ref, atol=0.05 * ref.abs().max().item(), rtol=0.05)
