"""LoRA's wrapper and its placement by ``parallelize``: the math, what is frozen, what the optimizer sees."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hybridflow.config.schema import FSDPConfig
from hybridflow.engine.parallel.lora import (
    LoraLinear,
    LoraSpec,
    adapters_disabled,
    apply_lora,
    linear_names,
    lora_modules,
)
from hybridflow.engine.parallel.parallelize import parallelize
from hybridflow.engine.train.optim import build_optimizer
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.models.adapters import merge_adapter_state, target_suffixes
from hybridflow.utils.errors import UserError


def trained(lin: LoraLinear) -> LoraLinear:
    """B random (a fresh adapter's B is zero, which would hide a wrong product)."""
    with torch.no_grad():
        lin.lora_B.weight.normal_()
    return lin


def test_the_wrapper_is_w_x_plus_alpha_over_r_b_a_x() -> None:
    torch.manual_seed(0)
    base = nn.Linear(12, 7)
    w, b = base.weight.detach().clone(), base.bias.detach().clone()
    lin = trained(LoraLinear(base, rank=4, alpha=8.0))
    x = torch.randn(3, 5, 12)
    a, bb = lin.lora_A.weight.detach(), lin.lora_B.weight.detach()
    manual = x @ w.T + b + (8.0 / 4) * (x @ a.T @ bb.T)  # (3, 5, 7)
    torch.testing.assert_close(lin(x), manual, atol=1e-6, rtol=0)
    merged = w + 2.0 * bb @ a  # the switch's and the export's W + (alpha / r) B A
    torch.testing.assert_close(lin.generation_tensor("weight"), merged, atol=1e-6, rtol=0)
    torch.testing.assert_close(x @ merged.T + b, manual, atol=1e-5, rtol=0)
    with adapters_disabled(lin):
        torch.testing.assert_close(lin(x), x @ w.T + b, atol=0, rtol=0)
    assert lin.adapter_enabled


def test_peft_init_and_names() -> None:
    torch.manual_seed(0)
    base = nn.Linear(16, 6, bias=False)
    lin = LoraLinear(base, rank=2, alpha=4.0)
    assert lin.weight is base.weight and not lin.weight.requires_grad
    assert (lin.lora_B.weight == 0).all() and lin.lora_A.weight.abs().sum() > 0
    assert lin.lora_A.weight.abs().max() <= 1 / 16**0.5 + 1e-6  # kaiming-uniform(a=sqrt(5)) bound 1/sqrt(in)
    assert [n for n, _ in lin.named_parameters()] == ["weight", "lora_A.weight", "lora_B.weight"]


@pytest.fixture(scope="module")
def tiny() -> nn.Module:
    model, _ = build_tiny_model_and_tokenizer(hidden_size=32, num_hidden_layers=2)
    return model


def test_targets_by_suffix_and_all_linear(tiny: nn.Module) -> None:
    model = copy.deepcopy(tiny)
    layers = list(model.model.layers)
    names = linear_names(layers)
    assert "self_attn.q_proj" in names and "mlp.down_proj" in names
    other = copy.deepcopy(model)
    assert apply_lora(other, list(other.model.layers), LoraSpec(2, 4.0, ("q_proj", "mlp.down_proj"))) == [
        "self_attn.q_proj",
        "mlp.down_proj",
    ]
    wrapped = apply_lora(model, list(model.model.layers), LoraSpec(2, 4.0))
    assert wrapped == names
    assert not isinstance(model.lm_head, LoraLinear)  # all-linear: the decoder layers only
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert target_suffixes(trainable) == names


def test_an_unknown_target_is_refused_naming_the_model_linears(tiny: nn.Module) -> None:
    model = copy.deepcopy(tiny)
    with pytest.raises(UserError, match=r"model.target_modules: \['qkv_proj'\].*q_proj"):
        apply_lora(model, list(model.model.layers), LoraSpec(2, 4.0, ("q_proj", "qkv_proj")))


@pytest.mark.parametrize(
    ("rank", "targets", "width"),
    [(33, ("all-linear",), 32), (100_000, ("all-linear",), 32), (17, ("k_proj", "v_proj"), 16)],
)
def test_a_rank_above_the_width_of_every_adapted_linear_is_refused_with_the_numbers(
    tiny: nn.Module, rank: int, targets: tuple[str, ...], width: int
) -> None:
    # the tiny model's linears: q, o, down min(in, out) = 32; gate, up 32; k, v (GQA) 32 -> 16
    model = copy.deepcopy(tiny)
    with pytest.raises(UserError) as err:
        apply_lora(model, list(model.model.layers), LoraSpec(rank, 16.0, targets))
    assert f"model.lora_rank={rank} is above the width of every linear it adapts" in str(err.value)
    assert "self_attn.k_proj, is in=32, out=16: 16" in str(err.value)
    assert str(err.value).endswith(f"Set model.lora_rank={width} or less")
    assert not lora_modules(model)  # refused before anything is wrapped


def test_a_rank_above_the_narrowest_linears_only_is_warned_and_applied(
    tiny: nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    # legitimate: one rank for all linears, the wide ones (32) use 20; k_proj and v_proj (16) saturate
    model = copy.deepcopy(tiny)
    with caplog.at_level("WARNING", logger="hybridflow.engine.parallel.lora"):
        apply_lora(model, list(model.model.layers), LoraSpec(20, 16.0, ("all-linear",)))
    assert "model.lora_rank=20 is above the width of self_attn.k_proj, self_attn.v_proj" in caplog.text
    assert "set model.lora_rank=16 or less" in caplog.text
    assert len(lora_modules(model)) == 2 * 7
    caplog.clear()
    fits = copy.deepcopy(tiny)
    with caplog.at_level("WARNING", logger="hybridflow.engine.parallel.lora"):
        apply_lora(fits, list(fits.model.layers), LoraSpec(16, 16.0, ("all-linear",)))
    assert not caplog.text  # a rank equal to the narrowest width is full rank there: nothing to say


def test_parallelize_keeps_the_base_frozen_and_the_optimizer_sees_only_adapters(tiny: nn.Module) -> None:
    model = copy.deepcopy(tiny)
    fsdp = FSDPConfig(param_dtype="bfloat16")  # the compute dtype of a GPU run, here on the CPU
    out = parallelize(model, None, fsdp, trainable=True, device=torch.device("cpu"), lora=LoraSpec(4, 8.0))
    params = dict(out.module.named_parameters())
    adapters = {n: p for n, p in params.items() if ".lora_" in n}
    base = {n: p for n, p in params.items() if ".lora_" not in n}
    assert all(p.dtype == torch.float32 and p.requires_grad for p in adapters.values())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in base.values())  # no fp32 master
    assert all(hasattr(p, "device_mesh") for p in params.values())  # FSDP2 shards both
    opt = build_optimizer(out.module.parameters(), 1e-3, 0.0, (0.9, 0.999), 1e-8)
    seen = {id(p) for g in opt.param_groups for p in g["params"]}
    assert seen == {id(p) for p in adapters.values()}
    assert len(lora_modules(out.module)) == 2 * 7
    # FSDP2 computes in bf16 over the mixed dtypes; only the adapters get (float32) gradients
    loss = out.module(input_ids=torch.randint(0, 40, (2, 9))).logits.float().square().mean()
    loss.backward()
    graded = {n for n, p in out.module.named_parameters() if p.grad is not None}
    assert graded == set(adapters) and all(adapters[n].grad.dtype == torch.float32 for n in graded)


def test_merging_a_state_dict_gives_the_wrapped_module(tiny: nn.Module) -> None:
    torch.manual_seed(1)
    model = copy.deepcopy(tiny)
    apply_lora(model, list(model.model.layers), LoraSpec(4, 8.0, ("q_proj", "down_proj")))
    for lin in lora_modules(model):
        trained(lin)
    plain = copy.deepcopy(tiny)
    plain.load_state_dict(merge_adapter_state(model.state_dict(), 2.0), strict=True)
    ids = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
