"""The generation view's weights per GPU and the bytes a switch moves, with experts split whole over ep_g ranks.

A generation view is (tp_g, dp_g) over W ranks with an expert-parallel size ep_g: 1 (each expert sliced over
its rollout group), tp_g (whole experts over the group's ranks) or tp_g x k for k dividing dp_g (whole experts
over k rollout groups together, the write-ups' "expert dimension kept independent" of tp). ``GenerateSplit``
is that view in numbers; ``expert_sizes`` the ep_g values a world and tp_g take. Rank r is tensor-parallel rank
``r // dp_g`` of rollout group ``r % dp_g`` (``engine.parallel.view.GenerateView``'s ordering), and holds the
experts of expert rank ``(r % dp_g) % k + k * (r // dp_g)``: at k = 1 the tensor-parallel rank, as the engine
splits them today; at k > 1 the engine's expert-parallel view being built for issue 66 orders them the same.

``switch_figures`` counts what the engine's reshard plan (``engine.hybrid.plan.ReshardPlan``) does, without
building it: each rank receives the part of its generation shard it does not hold in the training view (its
own part is a local copy), in the rollout dtype, every element once, from the boxes each rank holds in either
view (the engine's ``train_box`` and ``ShardLayout``). Whole experts go from a training holder to their generation
holder. Parameters of the same layout (every sparse layer alike) are counted once and
multiplied, so 671B on 128 ranks takes well under a second where the plan itself takes minutes.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import nn

from hybridflow.engine import ParallelDims, ShardLayout, kind_of, stage_of_param, train_box
from hybridflow.models.families import has_shard_rules, is_moe
from hybridflow.models.family import FAMILIES, FamilySpec, family_of
from hybridflow.models.moe import num_experts
from hybridflow.models.vision import text_config

Box = tuple[tuple[int, int], ...]

# every family's fused experts (``Experts.fused``): what expert parallelism splits whole
_EXPERTS = tuple(dict.fromkeys(n for s in FAMILIES.values() if s.experts for n in s.experts.fused))


def is_expert(name: str) -> bool:
    """Whether parameter ``name`` is a MoE block's fused experts (the router is not)."""
    return name.endswith(_EXPERTS)


def sliced_kind(name: str, family: FamilySpec | None) -> str:
    """A parameter's tensor-parallel kind in a rollout that slices each expert (the engine's ``kind_of``;
    ``replicated`` for a family without shard rules)."""
    return "replicated" if family is None else kind_of(name, family)


def trained_kind(config: Any, name: str, kind: str) -> str:
    """How the training view lays a parameter out: a mixture of experts' blocks whole on every tp rank, its
    fused experts split over the training ep (``experts``)."""
    if not is_moe(config) or ".mlp." not in name:
        return kind
    return "experts" if is_expert(name) else "replicated"


def volume(box: Box | None) -> int:
    """Elements in a box (0 for None)."""
    n = 0 if box is None else 1
    for lo, hi in box or ():
        n *= hi - lo
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of one parameter (None: nothing)."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


@dataclass(frozen=True)
class GenerateSplit:
    """``world`` ranks generating in groups of ``tp`` with experts split whole over ``ep`` ranks (ep = 1: each
    expert sliced over its group)."""

    world: int
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.world % self.tp or (self.ep > 1 and (self.ep % self.tp or self.dp % (self.ep // self.tp))):
            raise ValueError(
                f"ep={self.ep} with tp={self.tp} over {self.world} ranks: ep is 1 or tp x k, k | dp"
            )

    @property
    def dp(self) -> int:
        """Rollout groups."""
        return self.world // self.tp

    @property
    def span(self) -> int:
        """Rollout groups an expert group spans (k = ep / tp; 1 when the experts stay inside a group)."""
        return max(self.ep // self.tp, 1)

    def tp_rank(self, rank: int) -> int:
        """``rank``'s tensor-parallel rank inside its rollout group."""
        return rank // self.dp

    def ep_rank(self, rank: int) -> int:
        """``rank``'s expert rank: it holds experts ``ep_rank * E / ep`` to ``(ep_rank + 1) * E / ep - 1``."""
        return (rank % self.dp) % self.span + self.span * self.tp_rank(rank)

    def __str__(self) -> str:
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        return f"(tp={self.tp}{ep}, dp={self.dp})"


def expert_sizes(world: int, tp: int, experts: int) -> list[int]:
    """The ep_g values a generation view of ``world`` ranks at ``tp`` takes for a model of ``experts`` routed
    experts (whole experts, as many on every rank): 1, then tp x k for each k dividing dp_g (none for a dense
    model)."""
    if not experts or world % tp:
        return [1]
    dp = world // tp
    return [1, *(tp * k for k in range(1, dp + 1) if dp % k == 0 and tp * k > 1 and experts % (tp * k) == 0)]


@dataclass(frozen=True)
class SwitchFigures:
    """One generation view's figures per rank: its weights (bytes, the same on every rank) and the most any
    rank receives at a switch (bytes)."""

    generation_bytes: int
    received_bytes: int
    received: tuple[int, ...]  # bytes each rank receives


@dataclass(frozen=True)
class Part:
    """One parameter as the generation view holds it: its kind there (``whole_experts``: E / ep experts of
    ``split``'s expert rank), its shape and the rows of one KV head."""

    kind: str
    shape: tuple[int, ...]
    head_rows: int


def _part(name: str, shape: tuple[int, ...], split: GenerateSplit, family, head_rows: int) -> Part:
    """The generation layout of one parameter: whole experts, or the family's tensor-parallel kind."""
    if split.ep > 1 and is_expert(name):
        return Part("whole_experts", shape, head_rows)
    return Part(sliced_kind(name, family) if split.tp > 1 else "replicated", shape, head_rows)


def _needed(part: Part, split: GenerateSplit, rank: int) -> list[tuple[tuple[int, int], ...]]:
    """The boxes of the full parameter ``rank`` holds in the generation view."""
    if part.kind == "whole_experts":
        size = part.shape[0] // split.ep
        start = split.ep_rank(rank) * size
        return [((start, start + size), *((0, n) for n in part.shape[1:]))]
    box = ShardLayout(part.kind, part.shape, split.tp, part.head_rows).box(split.tp_rank(rank))
    return [] if box is None else [box]  # in the plan's coordinates: fused experts (E, 2, I, H)


def _local_elements(part: Part, split: GenerateSplit) -> int:
    """Elements of one rank's generation buffer of the parameter."""
    if part.kind == "whole_experts":
        return volume(tuple((0, n) for n in part.shape)) // split.ep
    return volume(
        tuple((0, n) for n in ShardLayout(part.kind, part.shape, split.tp, part.head_rows).local_shape())
    )


def switch_figures(
    model: nn.Module, view: ParallelDims, tp_generate: int, ep_generate: int = 1, rollout_bytes: int = 2
) -> SwitchFigures:
    """The generation weights per rank and the bytes each rank receives switching from training ``view`` into
    (tp_generate, ep_generate), counted as the reshard plan moves them (see the module doc)."""
    split = GenerateSplit(view.world, tp_generate, ep_generate)
    config = text_config(model.config)
    family = family_of(model.config) if has_shard_rules(model.config) else None
    tied = bool(getattr(config, "tie_word_embeddings", False))
    signatures: Counter[tuple] = Counter()
    for name, shape, part in _parts(model, split):
        sliced = sliced_kind(name, family)
        trained = trained_kind(config, name, sliced)
        # FSDP2 alone shards a row-parallel weight on dim 1 under a tensor-parallel rollout (view_memory's rule)
        fsdp_dim = int(view.fsdp_only and tp_generate > 1 and sliced == "row" and shape[1] % view.world == 0)
        stages = stage_of_param(name, config.num_hidden_layers, view.pp, tied)
        signatures[(part, trained, fsdp_dim, stages)] += 1
    received = [0] * view.world
    for (part, trained, fsdp_dim, stages), count in signatures.items():
        for rank, elements in enumerate(_received_elements(part, trained, fsdp_dim, stages, view, split)):
            received[rank] += count * elements
    out = tuple(r * rollout_bytes for r in received)
    weights = generation_bytes(model, view.world, tp_generate, ep_generate, rollout_bytes)
    return SwitchFigures(weights, max(out), out)


def generation_bytes(
    model: nn.Module, world: int, tp_generate: int, ep_generate: int = 1, rollout_bytes: int = 2
) -> int:
    """One rank's generation weights (bytes; the same on every rank): its tensor-parallel slices, and its
    E / ep_generate whole experts (or its slice of every expert at ep_generate = 1)."""
    split = GenerateSplit(world, tp_generate, ep_generate)
    return sum(_local_elements(part, split) for _, _, part in _parts(model, split)) * rollout_bytes


@functools.lru_cache(maxsize=64)
def _parts(model: nn.Module, split: GenerateSplit) -> list[tuple[str, tuple[int, ...], Part]]:
    """(name, shape, generation layout) of every parameter of ``model`` in the generation view ``split``."""
    config = text_config(model.config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    family = family_of(model.config) if has_shard_rules(model.config) else None
    return [
        (name, tuple(p.shape), _part(name, tuple(p.shape), split, family, head_dim))
        for name, p in model.named_parameters()
    ]


@functools.lru_cache(maxsize=4096)
def _received_elements(
    part: Part,
    trained: str,
    fsdp_dim: int,
    stages: tuple[int, ...],
    view: ParallelDims,
    split: GenerateSplit,
) -> tuple[int, ...]:
    """Elements of one parameter each rank receives: its generation boxes less what it holds itself."""
    out = []
    for rank in range(view.world):
        held = train_box(trained, part.shape, view, rank, fsdp_dim, stages)
        if held is not None and part.kind == "experts_column":  # the generation boxes' coordinates
            held = ShardLayout(part.kind, part.shape, split.tp, part.head_rows).to_plan(held)
        needed = _needed(part, split, rank)
        own = 0 if held is None else sum(volume(intersect(box, held)) for box in needed)
        out.append(sum(volume(box) for box in needed) - own)
    return tuple(out)


def moe_experts(model: nn.Module) -> int:
    """The model's routed experts per sparse layer (0: dense)."""
    return num_experts(text_config(model.config))
