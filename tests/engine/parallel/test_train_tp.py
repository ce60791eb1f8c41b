"""The training tensor-parallel plan (``engine/parallel/tp.py``) on its own, without the whole engine.

Without processes: the plan of a decoder layer of each family the engine trains with tp (Qwen2 with q/k/v
biases, Qwen3 with per-head q/k norms, Llama, Seed-OSS: its entry in models/family.py alone) splits q/k/v/gate/up by columns and o/down by rows, covers
every Linear and every parameter of the layer (a projection a family gains must fail here rather than stay
replicated unnoticed), and families without shard rules are refused; ``check_train_tp`` names the field,
the model fields that do not divide and the fix.

On two gloo processes: after ``apply_tp`` each rank holds the right slice of every projection, and the
model scores a batch of chat prompts and answers of different lengths, packed as the engine packs them and
padded, with the layer's output, the log-probs and every reassembled gradient of the unsharded model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.chat_rows import ANSWERS, trl_conversational_rows
from support.dist_util import run_world_kept as run_world
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from hybridflow.engine.parallel.tp import _plan, check_train_tp
from hybridflow.models import build_char_tokenizer, build_tiny_model
from hybridflow.models.family import FAMILIES as SPECS
from hybridflow.utils.errors import UserError

FAMILIES = ("qwen2", "qwen3", "llama", "seed_oss")  # the dense Llama-style families build_tiny_model builds
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")  # Qwen3: RMSNorm over each head's q and k
HIDDEN_NORMS = ("input_layernorm", "post_attention_layernorm")  # on the replicated hidden states
TP = 2
TEMPERATURE = 0.7


def tiny(arch: str, **sizes) -> nn.Module:
    """One decoder layer, hidden 32, 4 heads over 2 KV heads (GQA), the char tokenizer's vocabulary."""
    return build_tiny_model(arch, hidden_size=32, num_hidden_layers=1, seed=3, **sizes)


def owner(name: str) -> str:
    """The module path of a parameter name (``self_attn.q_proj.bias`` -> ``self_attn.q_proj``)."""
    return name.rsplit(".", 1)[0]


# ---------------------------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_plan_splits_every_projection_column_then_row(arch: str) -> None:
    layer = tiny(arch).model.layers[0]
    plan = _plan(layer, SPECS[arch])
    linears = {name for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
    split = {name for name, style in plan.items() if isinstance(style, (ColwiseParallel, RowwiseParallel))}
    assert split == linears == {*COLUMN, *ROW}, "a Linear of the layer is not in the plan (or gone)"
    for name in COLUMN:  # replicated input in, this rank's output features (heads, MLP rows) out
        style = plan[name]
        assert type(style) is ColwiseParallel, name
        assert style.input_layouts == (Replicate(),) and style.output_layouts == (Shard(-1),), name
        assert style.use_local_output, name  # the HF attention reshapes plain tensors with -1 heads
    for name in ROW:  # sharded input features in, the all-reduced (replicated) output out
        style = plan[name]
        assert type(style) is RowwiseParallel, name
        assert style.input_layouts == (Shard(-1),) and style.output_layouts == (Replicate(),), name
        assert style.use_local_output, name
    for name in HEAD_NORMS if arch == "qwen3" else ():  # weights replicated, input split on its heads dim
        style = plan[name]
        assert type(style) is SequenceParallel and style.use_local_output, name
        assert style.sequence_sharding == (Shard(2),), name  # (b, s, heads, head_dim)
    # Every parameter belongs to a planned module or to a norm over the replicated hidden states: a new
    # parameterised module (a bias on o_proj is still covered, a per-head gate would not be) fails here.
    unplanned = {owner(n) for n, _ in layer.named_parameters()} - set(plan)
    assert unplanned == set(HIDDEN_NORMS), unplanned
    assert set(plan) == {*COLUMN, *ROW, *(HEAD_NORMS if arch == "qwen3" else ())}


@pytest.mark.parametrize("arch,missing", [("gpt2", "'self_attn.q_proj'")])
def test_families_without_shard_rules_are_refused_by_the_check_and_by_the_plan(
    arch: str, missing: str
) -> None:
    """GPT-2 (fused c_attn, no KV groups): the config check refuses tp > 1 first, naming the family and the
    fix (tests/models/test_families.py covers every such family); a layer planned by an entry whose
    projections it lacks is refused naming them, never split in part."""
    model = tiny(arch, vocab_size=64)
    check_train_tp(model.config, 1)  # tp = 1 splits nothing and needs no rule
    with pytest.raises(UserError) as err:
        check_train_tp(model.config, TP, "critic")
    message = str(err.value)
    assert message.startswith(f"critic.tensor_parallel_size={TP}: ") and repr(arch) in message
    assert "et critic.tensor_parallel_size=1" in message  # "set ..." or "Set ..."
    layer = model.get_decoder().layers[0] if arch != "gpt2" else model.transformer.h[0]
    with pytest.raises(UserError) as err:
        _plan(layer, SPECS["llama"])
    message = str(err.value)
    assert missing in message and "tensor_parallel_size=1" in message and type(layer).__name__ in message
    assert "the llama family's entry" in message


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_splits_its_attention_and_keeps_its_moe_blocks_whole(arch: str) -> None:
    """Training tp for a MoE: q/k/v/o (and Qwen3's q/k norms) split, the router and experts whole on every tp
    rank, whether the block is HF's sparse block or the ``MoEBlock`` swapped in for it."""
    from hybridflow.models.moe import MoEBlock, install_moe

    model = tiny(arch, vocab_size=64)
    before = {name: type(style) for name, style in _plan(model.get_decoder().layers[0], SPECS[arch]).items()}
    install_moe(model)
    assert isinstance(model.get_decoder().layers[0].mlp, MoEBlock)
    check_train_tp(model.config, TP)  # heads and KV heads divide; the experts are not split
    plan = _plan(model.get_decoder().layers[0], SPECS[arch])
    assert not any(name.startswith("mlp.") for name in plan)
    assert {"self_attn.q_proj", "self_attn.o_proj"} <= plan.keys()
    assert {name: type(style) for name, style in plan.items()} == before
    # A dense layer of the same family (Qwen's mlp_only_layers) splits its MLP as the dense families do.
    if arch != "mixtral":
        dense = tiny(arch, vocab_size=64)
        dense.config.mlp_only_layers = [0]
        layer = type(dense.get_decoder().layers[0])(dense.config, 0)
        assert {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"} <= _plan(layer, SPECS[arch]).keys()


# --------------------------------------------------------------------------------- the model-size check


@pytest.mark.parametrize(
    "sizes,tp,role,fields",
    [
        (dict(num_attention_heads=4, num_key_value_heads=1), 2, "actor", "num_key_value_heads=1"),
        (
            dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3),
            4,
            "ref",
            "num_attention_heads=6, num_key_value_heads=3",  # heads not dividing implies KV heads neither
        ),
        (dict(intermediate_size=66, num_key_value_heads=4), 4, "critic", "intermediate_size=66"),
        (dict(), 3, "actor", "num_attention_heads=4, num_key_value_heads=2, intermediate_size=128"),
    ],
)
def test_sizes_tp_does_not_divide_are_refused_naming_the_field_and_the_fix(
    sizes: dict, tp: int, role: str, fields: str
) -> None:
    config = build_tiny_model(
        "qwen2", **{"hidden_size": 32, "vocab_size": 64, "num_hidden_layers": 1, **sizes}
    ).config
    check_train_tp(config, 1, role)  # tp = 1 always fits
    with pytest.raises(UserError) as err:
        check_train_tp(config, tp, role)
    assert str(err.value) == (
        f"{role}.tensor_parallel_size={tp} does not split this model for training: {fields} "
        "(each must be a multiple of it); use a tensor-parallel size that divides them"
    )


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_tiny_families_fit_tp_2_and_4(arch: str) -> None:
    config = tiny(arch, vocab_size=64, num_key_value_heads=4).config  # 4 heads, 4 KV heads, 128 MLP rows
    for tp in (1, 2, 4):
        check_train_tp(config, tp)


# ------------------------------------------------------------------------------ apply_tp on two processes


def chat_batch() -> dict[str, torch.Tensor]:
    """Chat prompts (left-padded) and answers (right-padded) of different lengths, with per-token weights."""
    tok = build_char_tokenizer()
    rows = trl_conversational_rows(4)  # prompt-only and prompt-completion rows, one with a system turn
    prompts, answers = [], []
    for i, row in enumerate(rows):
        text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text)["input_ids"])
        answer = row["completion"][0]["content"] if "completion" in row else ANSWERS[i]
        answers.append(tok(answer + tok.eos_token)["input_ids"])
    P, R = max(map(len, prompts)), max(map(len, answers))
    ids = torch.full((len(rows), P + R), tok.pad_token_id)
    mask = torch.zeros(len(rows), P + R, dtype=torch.long)
    for b, (prompt, answer) in enumerate(zip(prompts, answers)):
        ids[b, P - len(prompt) : P + len(answer)] = torch.tensor(prompt + answer)
        mask[b, P - len(prompt) : P + len(answer)] = 1
    g = torch.Generator().manual_seed(7)
    return {
        "input_ids": ids,  # (B, P + R)
        "attention_mask": mask,  # (B, P + R)
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),  # (B, P + R)
        "response_length": R,
        "weights": torch.randn(int(mask[:, P:].sum()), generator=g),  # (M,) one per response token
    }


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, a DTensor's reassembled (gathered, or summed where it is partial)."""
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for name, p in model.named_parameters()
    }


def score(model: nn.Module, batch: dict, packed: bool) -> dict:
    """One forward and backward of the engine's scorer: the layer's output at the tokens, log-probs, grads."""
    from hybridflow.engine.ops.packing import build_scoring_inputs
    from hybridflow.engine.train.scorer import PolicyScorer

    keys = ("input_ids", "attention_mask", "position_ids", "response_length")
    inputs = build_scoring_inputs(*(batch[k] for k in keys), remove_padding=packed)
    outs = []
    hook = model.model.layers[0].register_forward_hook(
        lambda m, args, out: outs.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        log_probs, _ = PolicyScorer(model, fused_head=False)(inputs, TEMPERATURE)  # (M,)
    finally:
        hook.remove()
    (-(log_probs * batch["weights"]).mean()).backward()
    hidden = outs[0]  # (1, S, H) packed, (B, T, H) padded: keep the real tokens only
    tokens = hidden[0] if packed else hidden[batch["attention_mask"].bool()]  # (S, H)
    result = {"layer": tokens.detach().clone(), "log_probs": log_probs.detach(), "grads": full_grads(model)}
    model.zero_grad(set_to_none=True)
    return result


def local_shards(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """This rank's placement and local tensor of every parameter of the decoder layer."""
    out = {}
    for name, p in model.model.layers[0].named_parameters():
        placements = str(tuple(p.placements)) if hasattr(p, "placements") else "plain"
        out[name] = (placements, (p.to_local() if hasattr(p, "to_local") else p).detach().clone())
    return out


def tp_against_whole(rank: int, batch: dict) -> dict:
    """Per family: the shards ``apply_tp`` leaves on this rank, and the tp model's and the whole model's
    scores of ``batch`` packed and padded; also whether a tp mesh of one rank leaves the layer as it is."""
    from torch.distributed.device_mesh import init_device_mesh

    from hybridflow.engine.ops.modules import decoder_layers
    from hybridflow.engine.ops.packed_attention import use_packed_attention
    from hybridflow.engine.parallel.dims import ParallelDims
    from hybridflow.engine.parallel.tp import apply_tp

    tp_mesh = ParallelDims(TP, tp=TP).build("cpu").tp_mesh
    out = {}
    for arch in FAMILIES:
        whole = tiny(arch)
        use_packed_attention(whole)  # as the engine runs (it still serves padded calls unchanged)
        split = copy.deepcopy(whole)
        apply_tp(decoder_layers(split), tp_mesh, split.config)
        out[arch] = {
            "shards": local_shards(split),
            **{
                layout: (score(split, batch, packed), score(whole, batch, packed))
                for layout, packed in (("packed", True), ("padded", False))
            },
        }
    one = init_device_mesh("cpu", (TP, 1), mesh_dim_names=("dp", "tp"))["tp"]  # a tp mesh of one rank
    model = tiny("qwen3")
    layers = decoder_layers(model)
    apply_tp(layers, one, model.config)
    out["one_rank_untouched"] = not any(hasattr(p, "placements") for p in layers[0].parameters())
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    """``tp_against_whole`` on each rank of one 2-process world."""
    return run_world(TP, tp_against_whole, chat_batch())


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_rank_holds_its_slice_of_every_projection(world: list[dict], arch: str) -> None:
    params = dict(tiny(arch).model.layers[0].named_parameters())
    for rank, out in enumerate(world):
        shards = out[arch]["shards"]
        assert shards.keys() == params.keys()
        for name, full in params.items():
            placements, local = shards[name]
            module = owner(name)
            if module in COLUMN:  # output features: weight rows (and bias entries) by rank
                want_placements, want = "(Shard(dim=0),)", full.chunk(TP, dim=0)[rank]
            elif module in ROW and name.endswith("weight"):  # input features: weight columns by rank
                want_placements, want = "(Shard(dim=1),)", full.chunk(TP, dim=1)[rank]
            elif module in HEAD_NORMS:  # head norms: every rank the whole weight, as a replicated DTensor
                want_placements, want = "(Replicate(),)", full
            else:  # the hidden-size norms stay plain tensors
                want_placements, want = "plain", full
            assert placements == want_placements, (rank, name)
            assert torch.equal(local, want.detach()), (rank, name)
    if arch == "qwen2":  # the biases are there and split with their rows
        assert world[1][arch]["shards"]["self_attn.k_proj.bias"][1].shape == (8,)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_the_split_layer_scores_and_differentiates_as_the_whole_one(
    world: list[dict], arch: str, layout: str
) -> None:
    for rank, out in enumerate(world):
        split, whole = out[arch][layout]
        torch.testing.assert_close(
            split["layer"], whole["layer"], rtol=0, atol=1e-5, msg=lambda m, r=rank: f"rank {r}: {m}"
        )
        torch.testing.assert_close(split["log_probs"], whole["log_probs"], rtol=0, atol=1e-5)
        assert split["grads"].keys() == whole["grads"].keys()
        for name, grad in whole["grads"].items():
            assert grad.abs().max() > 0, name  # every weight takes part in the loss
            # Relative: the gradients are ~1e-3. Reassembled they agree to ~1e-6 of it; a rank's sum over its
            # own heads only (Qwen3's q/k norms as plain tensors) is off by about all of it.
            torch.testing.assert_close(
                split["grads"][name],
                grad,
                rtol=1e-4,
                atol=1e-7,
                msg=lambda m, r=rank, n=name: f"{r} {n}: {m}",
            )
    assert len(whole["log_probs"]) == int(chat_batch()["weights"].numel())  # every response token scored


def test_a_tp_mesh_of_one_rank_leaves_the_layers_alone(world: list[dict]) -> None:
    assert all(out["one_rank_untouched"] for out in world)
