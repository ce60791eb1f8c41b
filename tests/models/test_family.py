"""The family entries (``models/family.py``) against the real modules, and what is derived from them.

Each entry with a tiny model is checked against that model: its layers are where it says, every module it names
exists, every parameter of a family with shard rules has a rule, the training plan and the rollout's rules
split the same projections the same way, and families agree on the names they share (``kind_of`` without a
family reads them all). Then what the entries decide: which families the built-in engine runs, the fallback
reason and warning of the others, a family without an entry, and the MoE routing and sizes.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from hybridflow.engine.parallel.layout import check_tp, kind_of
from hybridflow.engine.rollout.support import fallback_reason, unsupported_reason
from hybridflow.engine.rollout.tp import MOE_RULES, local_config
from hybridflow.models.families import disable_dropout, fallback_notice, has_shard_rules
from hybridflow.models.family import FAMILIES, KINDS, family_of, rollout_families
from hybridflow.models.moe import install_moe, router_spec
from hybridflow.models.tiny import build_tiny_model, tiny_archs
from hybridflow.models.vision import VISION_FAMILIES
from hybridflow.utils.errors import UserError

ARCHS = tiny_archs()


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    """Every family's tiny model: hidden 32, two layers."""
    return {
        arch: build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2) for arch in ARCHS
    }


def test_every_causal_family_has_a_tiny_model_that_runs(models: dict[str, nn.Module]) -> None:
    assert {"llama", "mistral", "qwen2", "qwen3", "seed_oss", "qwen2_moe", "mixtral", "gpt2"} <= set(ARCHS)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    for arch, model in models.items():
        assert model.config.model_type == arch and family_of(model.config) is FAMILIES[arch]
        assert model(ids).logits.shape == (2, 4, 64), arch


@pytest.mark.parametrize("arch", ARCHS)
def test_the_entry_names_modules_the_model_has(models: dict[str, nn.Module], arch: str) -> None:
    spec, model = FAMILIES[arch], models[arch]
    layers = model.get_submodule(spec.layers)
    assert isinstance(layers, nn.ModuleList) and len(layers) == 2
    install_moe(model)  # the trainer's MoEBlock keeps HF's names
    for layer in layers:
        names = {name for name, _ in layer.named_modules()} | {n for n, _ in layer.named_parameters()}
        block = spec.experts.block if spec.experts else None
        sparse = block is not None and f"{block}.experts" in names
        dense_mlp = [n for n in (*spec.column, *spec.row) if block and n.startswith(f"{block}.")]
        for name in (*spec.column, *spec.kv, *spec.row, *spec.norms, *spec.head_norms):
            if not (sparse and name in dense_mlp):  # a sparse layer has no dense MLP
                assert name in names, (arch, name)
        if sparse:
            assert {spec.experts.router, *spec.experts.fused} <= names, arch
            if spec.experts.shared:
                assert f"{block}.{spec.experts.shared}" in names, arch
    for name in (*spec.vocab, *([spec.final_norm] if spec.final_norm else [])):
        assert any(n == name or n.endswith(f".{name}") for n, _ in model.named_modules()), (arch, name)


@pytest.mark.parametrize("arch", [a for a in ARCHS if FAMILIES[a].has_shard_rules])
def test_every_parameter_has_one_rule_and_families_agree(models: dict[str, nn.Module], arch: str) -> None:
    spec = FAMILIES[arch]
    assert {kind for _, kind in spec.shard_rules()} <= set(KINDS)
    for name, _ in models[arch].named_parameters():
        hits = {kind for pattern, kind in spec.shard_rules() if re.search(pattern, name)}
        assert len(hits) == 1, (name, hits)  # a parameter no rule covers, or two that disagree
        assert kind_of(name, spec) == kind_of(name) == hits.pop(), name  # the union reads the same


@pytest.mark.parametrize("arch", [a for a in ARCHS if FAMILIES[a].has_shard_rules])
def test_the_training_plan_and_the_rollout_rules_split_the_same_projections(arch: str) -> None:
    # One fact, two readers: a column-parallel projection of training is column (or KV) in the rollout, a
    # row-parallel one row, and Qwen3's head norms replicated in both.
    spec = FAMILIES[arch]
    want = {"column": {"column", "kv"}, "row": {"row"}, "head_norm": {"replicated"}}
    for sparse in (False, True) if spec.experts else (False,):
        for module, kind in spec.train_plan(sparse).items():
            assert kind_of(f"model.layers.0.{module}.weight", spec) in want[kind], (arch, module)
    rollout_split = {
        m
        for m in (*spec.column, *spec.kv, *spec.row)
        if kind_of(f"model.layers.0.{m}.weight", spec) in ("column", "kv", "row")
    }
    assert rollout_split == set(spec.train_plan(sparse=False)) - set(spec.head_norms)


def test_every_family_the_engine_runs_has_the_names_its_binding_reads() -> None:
    # The rollout's binding (engine/rollout/binding.py) reads the Llama-style names; an entry the engine runs
    # with other names (Phi-3's fused qkv_proj) would pass the support check and fail to bind: more than an entry.
    bound = {f"self_attn.{p}_proj" for p in "qkvo"} | {f"mlp.{p}_proj" for p in ("gate", "up", "down")}
    for spec in FAMILIES.values():
        if spec.rollout is None and spec.text is None:
            assert set(spec.column) | set(spec.kv) | set(spec.row) <= bound, spec.name
            assert set(spec.norms) <= {"input_layernorm", "post_attention_layernorm"} and spec.layers == (
                "model.language_model.layers" if spec.part_of else "model.layers"
            ), spec.name
            assert set(spec.head_norms) <= {"self_attn.q_norm", "self_attn.k_norm"}, spec.name


def test_the_moe_rules_of_the_rollout_are_the_entries(models: dict[str, nn.Module]) -> None:
    kinds = {
        arch: {
            n.split("layers.0.")[1]: k
            for n, _ in models[arch].named_parameters()
            for p, k in MOE_RULES
            if "layers.0.mlp" in n and re.search(p, n)
        }
        for arch in ("qwen2_moe", "qwen3_moe", "mixtral")
    }
    assert kinds["qwen2_moe"] == {
        "mlp.gate.weight": "replicated",
        "mlp.experts.gate_up_proj": "experts_gate_up",
        "mlp.experts.down_proj": "experts_down",
        "mlp.shared_expert.gate_proj.weight": "column",
        "mlp.shared_expert.up_proj.weight": "column",
        "mlp.shared_expert.down_proj.weight": "row",
        "mlp.shared_expert_gate.weight": "replicated",
    }
    assert (
        kinds["qwen3_moe"]
        == kinds["mixtral"]
        == {
            "mlp.gate.weight": "replicated",
            "mlp.experts.gate_up_proj": "experts_gate_up",
            "mlp.experts.down_proj": "experts_down",
        }
    )


def test_the_expert_sizes_come_from_the_entries(models: dict[str, nn.Module]) -> None:
    # Mixtral's experts use intermediate_size; the Qwen mixtures size theirs (and a shared expert) apart.
    mixtral, qwen = models["mixtral"].config, models["qwen2_moe"].config
    assert (
        local_config(mixtral, 2).intermediate_size == 64
        and local_config(mixtral, 2, ep=2).intermediate_size == 128
    )
    local = local_config(qwen, 2)
    assert (local.moe_intermediate_size, local.shared_expert_intermediate_size) == (32, 64)
    assert local_config(qwen, 2, ep=2).moe_intermediate_size == 64  # whole experts keep their size
    with pytest.raises(UserError, match=r"=3 does not split this model's num_local_experts=4 experts"):
        check_tp(mixtral, 3, 3)  # the family's own field is named


def test_the_routing_comes_from_the_entries(models: dict[str, nn.Module]) -> None:
    qwen, mixtral, deepseek = (router_spec(models[a].config) for a in ("qwen3_moe", "mixtral", "deepseek_v3"))
    assert qwen.renormalize is bool(models["qwen3_moe"].config.norm_topk_prob) and not qwen.float32_weights
    assert mixtral.renormalize and mixtral.float32_weights and mixtral.num_experts == 4
    assert deepseek.scoring == "sigmoid" and deepseek.correction_bias and deepseek.num_groups == 2
    assert deepseek.scaling == models["deepseek_v3"].config.routed_scaling_factor
    assert router_spec(models["llama"].config) is None


def test_the_built_in_engine_runs_what_the_entries_say(models: dict[str, nn.Module]) -> None:
    assert set(VISION_FAMILIES) == {"qwen2_vl", "qwen2_5_vl"}
    assert "seed_oss" in rollout_families() and "gpt2" not in rollout_families()
    for arch, model in models.items():
        reason = fallback_reason(model, max_len=64)  # the tiny Mistral's window (4096) is never outgrown
        if FAMILIES[arch].rollout is None:
            assert reason is None, (arch, reason)
            continue
        assert reason.startswith(f"model_type {arch!r} {FAMILIES[arch].rollout}"), reason
        notice = fallback_notice(model.config, reason)
        assert notice.startswith(f"model family {arch!r} is outside the built-in rollout engine (it ")
        assert "seed_oss" in notice and "HF generate" in notice


def test_a_family_without_an_entry_falls_back_and_is_refused_every_split() -> None:
    from transformers import Phi3Config

    config = Phi3Config(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, vocab_size=64)
    assert family_of(config) is None and not has_shard_rules(config)
    reason = unsupported_reason(config)
    assert reason.startswith(
        "model_type 'phi3' has no entry in models/family.py; the rollout engine runs llama"
    )
    notice = fallback_notice(config, reason)
    assert notice.startswith(
        "model family 'phi3' is outside the built-in rollout engine (it has no entry in "
    )
    with pytest.raises(UserError, match=r"tensor_model_parallel_size=2: .* not for 'phi3'"):
        check_tp(config, 2)


def test_a_mistral_window_is_exact_only_within_it(models: dict[str, nn.Module]) -> None:
    config = models["mistral"].config
    window = config.sliding_window
    assert FAMILIES["mistral"].sliding_window and window is not None
    assert unsupported_reason(config, max_len=window) is None
    assert f"sliding window of {window} tokens" in unsupported_reason(config, max_len=window + 1)
    llama = models["llama"].config  # a family without a window ignores the field
    llama.sliding_window = 8
    assert unsupported_reason(llama, max_len=64) is None


def test_seed_oss_dropouts_are_turned_off_for_rl(models: dict[str, nn.Module]) -> None:
    # Seed-OSS keeps its 0.1 attention and residual rates as float attributes that F.dropout reads: the
    # residual ones were left on, so the update scored another distribution than the rollout sampled.
    model = build_tiny_model("seed_oss", vocab_size=64, hidden_size=32, num_hidden_layers=1).train()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert not torch.equal(model(ids).logits, model(ids).logits)
    assert disable_dropout(model) == ["attention_dropout=0.1", "residual_dropout=0.1"]
    assert torch.equal(model(ids).logits, model(ids).logits)
    layer = model.model.layers[0]
    assert layer.mlp.residual_dropout == layer.self_attn.residual_dropout == 0.0
    assert model.config.residual_dropout == 0.1  # the config keeps the model's own settings
