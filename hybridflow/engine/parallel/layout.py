"""Tensor-parallel shards of a model for the rollout, in Megatron's layout, by its family's shard rules.

Which parameter is column-, KV-, row- or vocabulary-parallel, replicated or an expert is its family's entry
(``models.family.FamilySpec.shard_rules``, the same projections the training plan splits); here is what each
kind means for the ranks.

Rank t of a rollout group of tp ranks holds: the t-th slice of the attention heads (q rows; k/v rows of its
KV heads, or, with fewer KV heads than tp, one whole KV head shared by tp / KVH ranks, as vLLM does) and of
the MLP's intermediate rows (gate/up), the matching columns of o and down (row-parallel: each rank's product
is a partial sum, all-reduced once per projection), and the t-th slice of the vocabulary of the embedding and
the LM head (vocabulary-parallel: ceil(V / tp) rows each, the last rank's padded). Norms are replicated. A
row-parallel bias lives on rank 0 only (zeros elsewhere), so the all-reduce adds it once.

The shard is an ordinary Hugging Face module of the same class whose config has the local sizes (heads / tp,
intermediate / tp, ceil(vocab / tp)); the rollout runner binds it as it binds any model and adds the
collectives (``RolloutTP``). ``ShardLayout`` says, per parameter, which box of the full tensor a rank holds:
the data the reshard plan is computed from.

A mixture of experts' layers follow the same rules (router replicated, shared expert as the dense MLP), and
the fused experts are sliced on their intermediate dim: down_proj (E, H, I) on dim 2, gate_up_proj (E, 2I, H)
in each of its halves (gate first, then up), so a rank's gate_up holds ``[gate_t; up_t]``, two boxes of the
full tensor. The plan sees it as (E, 2, I, H) (``plan_shape``, ``to_plan``, ``plan_view``), where the slice is
one box again. With expert parallelism in the rollout (``rollout.expert_parallel_size`` = tp) the experts are
instead split whole (kind ``experts_split``): rank t holds experts t * E / tp .. (t + 1) * E / tp - 1 of both
fused tensors, a box on dim 0, and adds only their share of each token's output before the same all-reduce.
With ep > tp (experts split across rollout groups, ``GenerateView.ep_rank``) the box is the expert rank's,
E / ep experts, also at tp = 1, where everything else is whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridflow.engine.parallel.ep import is_expert
from hybridflow.engine.parallel.fsdp import FSDP_SHARD_DIM
from hybridflow.models.families import check_tensor_parallel
from hybridflow.models.family import FAMILIES, FamilySpec, family_of
from hybridflow.models.moe import num_experts
from hybridflow.utils.errors import UserError

# One (start, stop) per dimension of a tensor: the part of a full parameter a rank holds or needs.
Box = tuple[tuple[int, int], ...]

# (name pattern, kind) of every family with shard rules (``FamilySpec.shard_rules``): the union ``kind_of``
# reads when no family is named. Families agree on the names they share (tests/models/test_family.py).
_RULES = tuple(dict.fromkeys(rule for spec in FAMILIES.values() for rule in spec.shard_rules()))
# the dim of the plan's shape (``ShardLayout.plan_shape``) each kind slices over tp
_SPLIT_DIM = {"row": 1, "experts_row": 2, "experts_column": 2, "experts_split": 0}


def _whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


@dataclass(frozen=True)
class ShardLayout:
    """Which box of a full parameter of ``shape`` each of ``tp`` rollout ranks holds (see the module doc)."""

    kind: str
    shape: tuple[int, ...]
    tp: int
    head_rows: int = 1  # rows of one KV head (kind "kv")
    ep: int = 0  # kind "experts_split": the expert ranks the experts split over (0: tp of them)

    @property
    def expert_parts(self) -> int:
        """How many ways ``experts_split`` splits the experts (ep, or tp when unset)."""
        return self.ep or self.tp

    @property
    def plan_shape(self) -> tuple[int, ...]:
        """The shape the plan sees: fused experts (E, 2I, H) as (E, 2, I, H), every other one as it is."""
        if self.kind != "experts_column":
            return self.shape
        e, two_i, *rest = self.shape
        return (e, 2, two_i // 2, *rest)

    def to_plan(self, box: Box | None) -> Box | None:
        """A box of the full tensor in the plan's coordinates (a fused-experts box spans its halves whole or
        lies inside one of them, as the training views hold it: whole experts)."""
        if box is None or self.kind != "experts_column":
            return box
        (lo, hi), half = box[1], self.shape[1] // 2
        if (lo, hi) == (0, 2 * half):
            return (box[0], (0, 2), (0, half), *box[2:])
        if hi - lo > 0 and lo // half == (hi - 1) // half:
            h = lo // half
            return (box[0], (h, h + 1), (lo - h * half, hi - h * half), *box[2:])
        raise ValueError(f"a box {box} of fused experts {self.shape} spans parts of both halves")

    def plan_view(self, t: torch.Tensor) -> torch.Tensor:
        """A rank's tensor (a training shard holding its experts' whole dim 1, or a generation buffer) viewed
        in the plan's coordinates."""
        if self.kind != "experts_column" or t.numel() == 0:
            return t
        return t.view(t.shape[0], 2, t.shape[1] // 2, *t.shape[2:])

    def local_shape(self) -> tuple[int, ...]:
        """The shape of a rank's buffer (the same on every rank; the last vocabulary slice is padded)."""
        if self.kind == "experts_split":  # whole experts over the expert ranks
            return (self.shape[0] // self.expert_parts, *self.shape[1:])
        if self.tp == 1 or self.kind in ("replicated", "first"):
            return self.shape
        if self.kind.startswith("experts"):  # the intermediate dim (of each half) over tp
            dim = 1 if self.kind == "experts_column" else 2
            return tuple(n // self.tp if d == dim else n for d, n in enumerate(self.shape))
        dim = 1 if self.kind == "row" else 0
        rows = self.shape[dim]
        if self.kind == "vocab":
            part = -(-rows // self.tp)
        elif self.kind == "kv" and rows // self.head_rows < self.tp:
            part = self.head_rows  # one whole KV head per rank, shared with others
        else:
            part = rows // self.tp
        return tuple(part if d == dim else n for d, n in enumerate(self.shape))

    def box(self, t: int, e: int | None = None) -> Box | None:
        """The box of the full tensor tensor-parallel rank ``t`` (expert rank ``e``: ``t`` when None) holds, in
        the plan's coordinates; None: none (its buffer is zeros)."""
        if self.kind == "experts_split":
            part = self.shape[0] // self.expert_parts
            start = (t if e is None else e) * part
            return ((start, start + part), *((0, n) for n in self.shape[1:]))
        if self.tp == 1 or self.kind == "replicated":
            return _whole(self.plan_shape)
        if self.kind.startswith("experts"):
            shape, dim = self.plan_shape, _SPLIT_DIM[self.kind]
            part = shape[dim] // self.tp
            return tuple((t * part, (t + 1) * part) if d == dim else (0, n) for d, n in enumerate(shape))
        if self.kind == "first":
            return _whole(self.shape) if t == 0 else None
        dim = 1 if self.kind == "row" else 0
        part = self.local_shape()[dim]
        if self.kind == "kv" and self.shape[0] // self.head_rows < self.tp:
            heads = self.shape[0] // self.head_rows
            start = (t * heads // self.tp) * self.head_rows  # ranks t.. share KV head t * KVH // tp
        else:
            start = t * part
        stop = min(start + part, self.shape[dim])
        if start >= stop:  # a vocabulary smaller than (tp - 1) slices: this rank's slice is all padding
            return None
        return tuple((start, stop) if d == dim else (0, n) for d, n in enumerate(self.shape))


def kind_of(name: str, family: FamilySpec | None = None) -> str:
    """The tensor-parallel kind of a parameter, from its name and its family's shard rules (``family=None``:
    any family's, which agree on the names they share); UserError when no rule covers it."""
    rules = _RULES if family is None else family.shard_rules()
    for pattern, kind in rules:
        if re.search(pattern, name):
            return kind
    where = "any family with shard rules" if family is None else f"the {family.name} family's entry"
    raise UserError(
        f"parameter {name!r} has no tensor-parallel layout for the rollout (no shard rule of {where}, "
        "models/family.py); set rollout.tensor_model_parallel_size=1"
    )


def _family(model: nn.Module) -> FamilySpec | None:
    """The entry of ``model``'s family, when it has one with shard rules (None: ``kind_of`` reads them all)."""
    spec = family_of(getattr(model, "config", None))
    return spec if spec is not None and spec.has_shard_rules else None


def layouts(model: nn.Module, tp: int, ep: int = 1) -> dict[str, ShardLayout]:
    """The ``ShardLayout`` of every parameter of ``model`` (names as ``named_parameters`` gives them); ``ep``
    > 1 splits a mixture of experts' experts whole over ep expert ranks instead of slicing each one."""
    config, family = model.config, _family(model)
    if tp == 1:  # a whole replica: every parameter whole, whatever the family (no shard rule needed) ...
        whole = {name: ShardLayout("replicated", tuple(p.shape), 1) for name, p in model.named_parameters()}
        if ep > 1:  # ... but the experts, split whole across the replicas of an expert group
            for name, p in model.named_parameters():
                if is_expert(name):
                    whole[name] = ShardLayout("experts_split", tuple(p.shape), 1, ep=ep)
        return whole
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        name: ShardLayout(
            generation_kind(name, ep, family), tuple(p.shape), tp, head_dim, ep if ep > 1 else 0
        )
        for name, p in model.named_parameters()
    }


def generation_kind(name: str, ep: int = 1, family: FamilySpec | None = None) -> str:
    """``kind_of`` for a generation view whose experts are split whole over its group when ``ep`` > 1."""
    kind = kind_of(name, family)
    return "experts_split" if ep > 1 and kind in ("experts_column", "experts_row") else kind


def follow_rollout_shards(model: nn.Module, world: int, tp: int) -> int:
    """Mark the row-parallel weights (o, down) of ``model`` for FSDP2 to shard on dim 1; returns how many.

    FSDP2 shards dim 0 by default, but a row-parallel rollout shard is a slice of columns: sharded on dim 1,
    a rank's training shard lies inside its generation shard (``GenerateView``'s ordering), so the switch
    gathers it from the rank's own tensor-parallel peers only, and at tp = W not at all. FSDP2 shards dim 1
    only evenly, so a dimension the ranks do not divide keeps dim 0. Call before the engine shards ``model``.
    """
    if tp == 1:
        return 0
    marked, family = 0, _family(model)
    for name, param in model.named_parameters():
        if kind_of(name, family) == "row" and param.shape[1] % world == 0:
            setattr(param, FSDP_SHARD_DIM, 1)
            marked += 1
    return marked


def moe_problems(config: Any, tp: int, ep: int = 1) -> list[str]:
    """The sparse blocks' sizes ``tp`` does not divide ("field=value" each; none for a dense config): every
    expert's intermediate dim, or with ``ep`` > 1 (experts split whole) their number; a shared expert's. The
    fields are the family entry's (``family.Experts``)."""
    spec = family_of(config)
    experts = spec.experts if spec is not None else None
    if experts is None or not num_experts(config):
        return []
    if ep > 1:  # whole experts: their number, not their size
        problems = [f"{experts.count}={num_experts(config)}"] if num_experts(config) % max(ep, tp) else []
        fields = [experts.shared_size]
    else:
        problems, fields = [], [experts.size, experts.shared_size]
    fields = [f for f in fields if f and f != "intermediate_size"]  # the dense MLP's, checked by check_tp
    problems += [
        f"{f}={getattr(config, f)}" for f in fields if getattr(config, f, None) and getattr(config, f) % tp
    ]
    return problems


def check_tp(config: Any, tp: int, ep: int = 1) -> None:
    """Raise UserError naming the fields when ``tp`` cannot split this model's heads, MLP and experts (or the
    family has no shard rules); ``ep`` = tp: the experts split whole (``rollout.expert_parallel_size``)."""
    check_tensor_parallel(config, "rollout.tensor_model_parallel_size", tp)
    if ep > 1 and not num_experts(config):
        raise UserError(
            f"rollout.expert_parallel_size={ep} splits a mixture of experts' experts, but this model is dense "
            f"({getattr(config, 'model_type', '?')}): set rollout.expert_parallel_size=1"
        )
    if ep > 1 and num_experts(config) % ep:
        field = family_of(config).experts.count
        raise UserError(
            f"rollout.expert_parallel_size={ep} does not split this model's {field}={num_experts(config)} "
            "experts whole: use an expert-parallel size that divides them, or set rollout.expert_parallel_size=1"
        )
    if tp == 1:  # nothing to split (and a family without shard rules may lack the fields below)
        return
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads={heads}")
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} (a multiple of tp, or a divisor of it)")
    spec = family_of(config)
    experts = spec.experts if spec is not None else None
    # Mixtral's experts use intermediate_size: split whole (ep > 1), it need not divide
    whole = ep > 1 and experts is not None and experts.size == "intermediate_size"
    if config.intermediate_size % tp and not whole:
        problems.append(f"intermediate_size={config.intermediate_size}")
    problems += moe_problems(config, tp, ep)  # each expert sliced on its intermediate dim, or split whole
    if problems:
        raise UserError(
            f"rollout.tensor_model_parallel_size={tp} does not split this model: {', '.join(problems)}; "
            "use a tensor-parallel size that divides them, or set rollout.tensor_model_parallel_size=1"
        )
