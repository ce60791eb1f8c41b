"""Model families: which run the built-in engine and its shard rules, the refusals that name them, dropout."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.parallel.layout import check_tp, layouts
from hybridflow.engine.parallel.pipeline import check_train_pp
from hybridflow.engine.parallel.tp import check_train_tp
from hybridflow.engine.parallel.ulysses import check_ulysses
from hybridflow.engine.rollout.support import fallback_reason
from hybridflow.models import build_tiny_model
from hybridflow.models.families import (
    check_tensor_parallel,
    disable_dropout,
    fallback_notice,
    has_shard_rules,
    is_moe,
)
from hybridflow.utils.errors import UserError

DENSE = ("qwen2", "qwen3", "llama")
OTHERS = ("gpt2", "qwen2_moe", "qwen3_moe", "mixtral")
MOE = ("qwen2_moe", "qwen3_moe", "mixtral")


def tiny(arch: str, **kw) -> torch.nn.Module:
    return build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=1, **kw)


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {arch: tiny(arch) for arch in (*DENSE, *OTHERS)}


def test_every_family_builds_and_runs_a_forward(models: dict[str, torch.nn.Module]) -> None:
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    for arch, model in models.items():
        assert model.config.model_type == arch
        assert model(ids).logits.shape == (2, 4, 64), arch
    assert models["gpt2"].config.tie_word_embeddings  # GPT-2 ties its head, as the released models do
    assert not models["mixtral"].config.tie_word_embeddings
    assert models["qwen2_moe"].config.num_experts == models["mixtral"].config.num_local_experts == 4


def test_which_family_runs_where(models: dict[str, torch.nn.Module]) -> None:
    for arch in DENSE:
        config = models[arch].config
        assert has_shard_rules(config) and not is_moe(config)
        assert fallback_reason(models[arch]) is None  # the built-in engine runs it
    assert not is_moe(models["gpt2"].config) and not has_shard_rules(models["gpt2"].config)
    for arch in ("qwen2_moe", "qwen3_moe", "mixtral"):  # a tensor-parallel rollout slices their experts
        assert is_moe(models[arch].config) and has_shard_rules(models[arch].config)
    # The built-in engine runs the mixtures of experts too (issue 42); GPT-2 falls back to HF generate.
    for arch in ("qwen2_moe", "qwen3_moe", "mixtral"):
        assert fallback_reason(models[arch]) is None
    assert "model_type 'gpt2' is not a Llama-style decoder: learned positions" in fallback_reason(
        models["gpt2"]
    )


def test_the_fallback_warning_names_the_family_and_why(models: dict[str, torch.nn.Module]) -> None:
    gpt2 = fallback_notice(models["gpt2"].config, fallback_reason(models["gpt2"]))
    assert "'gpt2' is outside the built-in rollout engine" in gpt2 and "HF generate" in gpt2
    moe = fallback_notice(models["mixtral"].config, "a reason of this model")  # a family it runs: the reason
    assert "'mixtral' is outside the built-in rollout engine (this mixtral model: a reason" in moe


def test_a_tensor_parallel_moe_rollout_needs_sizes_that_divide_every_expert() -> None:
    # tp = 2 slices every expert (and the shared expert) on its intermediate dim; an odd one is named.
    for arch in ("qwen2_moe", "qwen3_moe", "mixtral"):
        check_tp(tiny(arch).config, 2)
    odd = tiny("qwen2_moe", intermediate_size=66).config  # moe_intermediate_size = 33, shared 66
    with pytest.raises(
        UserError, match=r"tensor_model_parallel_size=2 does not split .*moe_intermediate_size=33"
    ):
        check_tp(odd, 2)
    with pytest.raises(
        UserError, match=r"=4 does not split .*intermediate_size=66, moe_intermediate_size=33, "
    ):
        check_tp(odd, 4)  # 4 heads, 2 KV heads: only the MLP sizes


def test_a_mixture_of_experts_without_rules_is_still_refused() -> None:
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=32, num_attention_heads=4, n_routed_experts=4)
    assert is_moe(config) and not has_shard_rules(config)
    for key in ("rollout.tensor_model_parallel_size", "actor.tensor_parallel_size"):
        with pytest.raises(UserError, match=rf"{key}=2: .* not for 'deepseek_v3'; set {key}=1"):
            check_tensor_parallel(config, key, 2)


@pytest.mark.parametrize("arch", OTHERS)
@pytest.mark.parametrize(
    "check,key",
    [
        (lambda c, n: check_tp(c, n), "rollout.tensor_model_parallel_size=2"),
        (lambda c, n: check_train_tp(c, n, "actor"), "actor.tensor_parallel_size=2"),
        (lambda c, n: check_train_tp(c, n, "critic"), "critic.tensor_parallel_size=2"),
    ],
)
def test_tensor_parallelism_is_refused_for_families_without_shard_rules(
    models: dict[str, torch.nn.Module], arch: str, check, key: str
) -> None:
    config = models[arch].config
    check(config, 1)  # tp = 1 needs no rule
    if arch in MOE:
        # training splits a MoE's attention and keeps its MoE blocks whole on every tp rank; the rollout
        # slices every expert on its intermediate dim
        check(config, 2)
        return
    with pytest.raises(UserError) as err:
        check(config, 2)
    message = str(err.value)
    assert message.startswith(key) and f"et {key[:-2]}=1" in message and repr(arch) in message


def test_pipeline_and_ulysses_are_refused_only_where_the_decoder_is_not_llama_style(
    models: dict[str, torch.nn.Module],
) -> None:
    with pytest.raises(UserError, match=r"actor.pipeline_parallel_size=2: pipeline .* not 'gpt2'"):
        check_train_pp(models["gpt2"].config, 2)
    with pytest.raises(UserError, match=r"actor.ulysses_sequence_parallel_size=2: .* not 'gpt2'"):
        check_ulysses(models["gpt2"].config, 2)
    for arch in ("qwen2", "qwen2_moe", "mixtral"):  # Llama-style decoders, dense or MoE, split either way
        check_train_pp(build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2).config, 2)
        check_ulysses(models[arch].config, 2)


def test_a_whole_replica_needs_no_shard_rule(models: dict[str, torch.nn.Module]) -> None:
    for arch in OTHERS:
        lay = layouts(models[arch], 1)
        assert all(
            x.kind == "replicated" and x.box(0) == tuple((0, n) for n in x.shape) for x in lay.values()
        )
    check_tensor_parallel(models["qwen2"].config, "rollout.tensor_model_parallel_size", 2)  # has rules


def test_disable_dropout_makes_training_mode_deterministic() -> None:
    model = tiny("gpt2").train()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.manual_seed(0)
    assert not torch.equal(model(ids).logits, model(ids).logits)  # GPT-2's 0.1 dropouts are on
    turned_off = disable_dropout(model)
    assert {"attn_pdrop=0.1", "embd_pdrop=0.1", "resid_pdrop=0.1"} <= set(turned_off)
    with torch.no_grad():
        trained = model(ids).logits
        assert torch.equal(trained, model(ids).logits)
        assert torch.equal(trained, model.eval()(ids).logits)  # what the rollout samples from
    assert model.config.attn_pdrop == 0.1  # the config (and so an export) keeps the model's own settings
    assert disable_dropout(tiny("qwen2")) == []  # the Llama family has none


def test_disable_dropout_covers_the_llama_style_attention_rate() -> None:
    model = build_tiny_model("llama", vocab_size=64, hidden_size=32, num_hidden_layers=1)
    model.config.attention_dropout = 0.2
    model.model.layers[0].self_attn.attention_dropout = 0.2
    assert disable_dropout(model) == ["attention_dropout=0.2"]
    assert model.model.layers[0].self_attn.attention_dropout == 0.0
