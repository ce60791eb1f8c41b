"""Memory per rank of a training view and its switch into a generation view, from the parameter shapes alone.

The same accounting the engine does: every rank's held box of every parameter (``dims.train_box``, what
the DTensors give), the reshard plan of the two views (``plan.ReshardPlan``) for the generation shard and the
bytes a switch moves. No weights are needed: the model may live on the meta device, so a 70B shape costs
nothing to plan. ``benchmarks/views.py`` prints these figures per view; the trainer's automatic layout
(``plan.search``) adds the activations and the KV cache to them for each phase.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from hybridflow.engine.hybrid.plan import ParamSpec, ReshardPlan, volume
from hybridflow.engine.parallel.dims import ParallelDims, train_box
from hybridflow.engine.parallel.ep import is_expert
from hybridflow.engine.parallel.layout import ShardLayout, check_tp, generation_kind
from hybridflow.engine.parallel.pipeline import stage_of_param
from hybridflow.engine.parallel.tp import check_train_tp
from hybridflow.engine.parallel.view import GenerateView
from hybridflow.models.families import has_shard_rules, is_moe
from hybridflow.models.family import family_of
from hybridflow.models.vision import text_config

MASTER_BYTES = 4  # float32 masters
GRAD_BYTES = 4  # float32 gradients
MOMENT_BYTES = 8  # AdamW's exp_avg and exp_avg_sq, float32


@dataclass(frozen=True)
class ViewMemory:
    """Bytes per rank (the largest over the ranks) of one training view switching into one generation view."""

    train_view: str
    generate_view: str
    held_elements: int  # parameter elements the rank holds in the training view
    layer_bytes: int  # one decoder layer gathered in the compute dtype (its tensor-parallel piece)
    generation_bytes: int  # the rank's generation shard in the rollout dtype
    received_bytes: int | None  # the most any rank receives at one switch (None: not computed)
    full_elements: int  # parameter elements of the whole model

    def state_bytes(
        self, master: int = MASTER_BYTES, grad: int = GRAD_BYTES, moments: int = MOMENT_BYTES
    ) -> int:
        """The trained role's state per rank: masters + gradients + optimizer moments (bytes per element)."""
        return self.held_elements * (master + grad + moments)


def unsplit_reason(model: nn.Module, tp_train: int, tp_generate: int, ep_generate: int = 1) -> str | None:
    """None when both tensor-parallel sizes split the model's heads and MLP (and the generation view its
    experts, sliced or, with ``ep_generate`` = tp_generate, whole), else what they do not split."""
    try:
        check_train_tp(model.config, tp_train)
        check_tp(model.config, tp_generate, ep_generate)
    except ValueError as e:
        return str(e)
    return None


def _trained_kind(config: Any, name: str, kind: str) -> str:
    """The kind ``train_box`` lays a parameter out by: a mixture of experts' blocks whole on every tp rank,
    its fused experts split over ep (``experts``, whole at ep = 1)."""
    if not is_moe(config) or ".mlp." not in name:
        return kind
    return "experts" if is_expert(name) else "replicated"


def view_memory(
    model: nn.Module,
    view: ParallelDims,
    tp_generate: int,
    rollout_bytes: int = 2,
    compute_bytes: int = 2,
    switch: bool = True,
    ep_generate: int = 1,
) -> ViewMemory:
    """The per-rank figures of ``view`` switching into generation groups of ``tp_generate`` ranks.

    As the engine lays them out: each pipeline stage holding its own layers (the embedding on the first, the
    norm and head on the last, a tied head on both), FSDP2 over dp, the projections split over tp (embedding,
    norms and head replicated), row-parallel weights sharded by FSDP2 on dim 1 when training is FSDP2 alone
    and the rollout tensor-parallel (``follow_rollout_shards``). MoE blocks train whole on every tp rank, experts
    split over ``view.ep``, and generate sliced over tp_generate or split whole (``ep_generate`` = tp_generate).
    ``switch=False`` leaves out the plan's transfers (``received_bytes`` None): at hundreds of ranks they are
    what takes the time.
    """
    world = view.world
    config = text_config(model.config)  # a vision-language model's text model (its tower's weights count too)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    # A family without shard rules (GPT-2) only ever has whole weights here: tp = 1 in both views
    # (unsplit_reason refuses more), so every parameter is whole and needs no rule.
    family = family_of(model.config) if has_shard_rules(model.config) else None
    kinds = [generation_kind(n, ep_generate, family) if family else "replicated" for n, _ in params]
    trained = [_trained_kind(config, n, k) for k, (n, _) in zip(kinds, params)]
    lays = [ShardLayout(k, shape, tp_generate, head_dim) for k, (_, shape) in zip(kinds, params)]
    fsdp_dims = [
        1 if view.fsdp_only and tp_generate > 1 and k == "row" and shape[1] % world == 0 else 0
        for k, (_, shape) in zip(kinds, params)
    ]
    # torch.chunk makes the first of the dp chunks the largest: without the switch, the dp rank 0 of each
    # stage and tensor-parallel rank is enough to find the most any rank holds.
    ranks = range(world) if switch else [r for r in range(world) if view.coords(r)[2] == 0]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    stages = [stage_of_param(n, config.num_hidden_layers, view.pp, tied) for n, _ in params]
    holdings = [
        [
            lay.to_plan(train_box(k, shape, view, r, d, st))  # fused experts in the plan's (E, 2, I, H)
            for lay, k, (_, shape), d, st in zip(lays, trained, params, fsdp_dims, stages)
        ]
        for r in ranks
    ]
    specs = [ParamSpec(n, lay.plan_shape, None, lay) for lay, (n, _) in zip(lays, params)]
    generate = GenerateView(world, tp_generate, ep_generate)
    received = None
    if switch:
        plan = ReshardPlan(specs, generate, rollout_bytes, 512 * 2**20, holdings, str(view))
        received = max(plan.bytes_received(r) for r in range(world))
    first = re.compile(r"\.(layers|h)\.0\.")  # the first decoder layer (GPT-2 names its layers h)
    layer = sum(volume(tuple((0, d) for d in s)) for n, s in params if first.search(n))
    local = (volume(tuple((0, d) for d in spec.layout.local_shape())) for spec in specs)
    return ViewMemory(
        train_view=str(view),
        generate_view=str(generate),
        held_elements=max(sum(volume(b) for b in held) for held in holdings),
        layer_bytes=layer * compute_bytes // view.tp,
        generation_bytes=sum(local) * rollout_bytes,  # ReshardPlan.generation_bytes, without the plan
        received_bytes=received,
        full_elements=sum(volume(tuple((0, d) for d in s)) for _, s in params),
    )
