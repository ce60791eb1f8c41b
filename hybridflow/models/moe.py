"""Mixture-of-experts layers: one routing function and one grouped expert computation for the trainer and engine.

transformers 5 stores a sparse block's experts fused: ``experts.gate_up_proj`` (E, 2I, H), gate half first, and
``experts.down_proj`` (E, H, I); the router ``gate.weight`` (E, H) is applied with ``F.linear``. Routing differs
by family (``RouterSpec``, from the family's ``family.Experts`` entry): Qwen2/3-MoE take a float32 softmax, the
top k, and renormalise only with ``norm_topk_prob``; Mixtral always renormalises and keeps the weights in
float32; DeepSeek-V3 scores with a sigmoid, picks with a correction bias and a group limit, and scales by
``routed_scaling_factor``.

``route`` is the one routing function: the trainer's ``MoEBlock`` (swapped in for HF's block at load, same
parameter names) and the rollout engine both call it, so a token's experts are chosen by the same float32
arithmetic on both sides. With ``replay`` (router replay, R3) the experts are given, and only their weights
are recomputed from this forward's scores, so the router still learns.

``grouped_experts`` runs every token's k experts as two grouped GEMMs (``F.grouped_mm``) over the assignments
sorted by expert, with fixed shapes throughout (no host sync: capturable in a CUDA graph); ``loop_experts``
is the reference loop over experts, in HF's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.family import FAMILIES, expert_fields, family_name, family_of
from hybridflow.utils.errors import UserError

# A routing record's "no expert" id (uint8): the token was not routed where the record was made.
NO_EXPERT = 255


@dataclass(frozen=True)
class RouterSpec:
    """How one family turns router logits (N, E) into k experts and their weights per token."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" (Qwen, Mixtral) or "sigmoid" (DeepSeek-V3)
    renormalize: bool = False
    float32_weights: bool = False  # Mixtral, DeepSeek: weights stay float32; Qwen: cast to the logits' dtype
    float32_logits: bool = False  # DeepSeek: the router's matmul itself in float32
    num_groups: int = 1  # DeepSeek's group-limited choice: keep the best topk_groups of num_groups
    topk_groups: int = 1
    scaling: float = 1.0  # DeepSeek's routed_scaling_factor
    correction_bias: bool = False  # DeepSeek: e_score_correction_bias added for the choice only


def num_experts(config: Any) -> int:
    """The number of routed experts of a config (0: dense), read from any family's expert-count field."""
    for field in expert_fields():
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def router_spec(config: Any) -> RouterSpec | None:
    """The routing of a HF MoE config (None for a dense one), as its family's entry says (``family.Experts``);
    UserError for a family whose routing is unknown."""
    experts = num_experts(config)
    if not experts:
        return None
    spec = family_of(config)
    e = spec.experts if spec is not None else None
    if e is None:
        known = ", ".join(s.name for s in FAMILIES.values() if s.experts is not None)
        raise UserError(
            f"model_type {family_name(config)!r} is a mixture of experts whose routing hybridflow does not know; "
            f"supported: {known}"
        )
    renormalize = e.renormalize if e.renormalize_field is None else getattr(config, e.renormalize_field, None)
    return RouterSpec(
        experts,
        int(config.num_experts_per_tok),
        scoring=e.scoring,
        renormalize=bool(e.renormalize if renormalize is None else renormalize),
        float32_weights=e.float32_weights,
        float32_logits=e.float32_logits,
        num_groups=int(getattr(config, "n_group", 1) or 1) if e.grouped else 1,
        topk_groups=int(getattr(config, "topk_group", 1) or 1) if e.grouped else 1,
        scaling=float(getattr(config, e.scaling_field, 1.0)) if e.scaling_field else 1.0,
        correction_bias=e.correction_bias,
    )


def _choose(scores: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> torch.Tensor:
    """The top-k expert ids (N, k) from float32 scores (N, E): DeepSeek's bias and group limit when set."""
    if not spec.correction_bias and spec.num_groups == 1:
        return torch.topk(scores, spec.top_k, dim=-1)[1]
    pick = scores if bias is None else scores + bias  # (N, E)
    if spec.num_groups > 1:
        n, e = pick.shape
        grouped = pick.view(n, spec.num_groups, e // spec.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # (N, G): a group's two best experts
        keep = torch.topk(group_scores, spec.topk_groups, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)  # (N, G)
        pick = pick.masked_fill(~mask.repeat_interleave(e // spec.num_groups, dim=1), float("-inf"))
    return torch.topk(pick, spec.top_k, dim=-1, sorted=False)[1]


def route(
    logits: torch.Tensor,
    spec: RouterSpec,
    bias: torch.Tensor | None = None,
    replay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, k), expert ids (N, k) int64) from router logits (N, E), in float32 as the family does.

    ``replay`` (N, k): use these experts (router replay) and recompute only their weights from the scores;
    rows of ``NO_EXPERT`` (a token the rollout never fed, the last one) keep this router's own choice.
    """
    weights, ids, _ = route_and_choose(logits, spec, bias, replay)
    return weights, ids


def route_and_choose(
    logits: torch.Tensor,
    spec: RouterSpec,
    bias: torch.Tensor | None = None,
    replay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``route``'s (weights, ids), then the router's own choice (N, k) (the ids themselves without replay)."""
    scores = logits.float()
    scores = torch.softmax(scores, dim=-1) if spec.scoring == "softmax" else scores.sigmoid()  # (N, E)
    own = _choose(scores, spec, bias)  # (N, k)
    ids = own
    if replay is not None:
        replay = replay.long()
        ids = torch.where(replay == NO_EXPERT, own, replay)  # (N, k)
    weights = scores.gather(1, ids)  # (N, k)
    if spec.renormalize:
        denom = weights.sum(-1, keepdim=True)
        weights = weights / (denom + 1e-20 if spec.scoring == "sigmoid" else denom)
    if spec.scaling != 1.0:
        weights = weights * spec.scaling
    return (weights if spec.float32_weights else weights.to(logits.dtype)), ids, own


def router_logits(x: torch.Tensor, weight: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """The router's logits (N, E) for tokens x (N, H): in x's dtype, or float32 where the family says."""
    if spec.float32_logits:
        return F.linear(x.float(), weight.float())
    return F.linear(x, weight)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: grouped_mm's CPU backward refuses a stride-0
    gradient (one that came from ``y.sum()``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm_fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` runs these shapes here: float32/bf16/fp16 on CPU, bf16 on a CUDA GPU of SM90 or
    newer, and every row of each operand a multiple of 16 bytes."""
    grouped = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped is None or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:  # its meta kernel takes bf16 only
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9):
        return False
    size = x.element_size()
    return all(d * size % 16 == 0 for d in (*gate_up.shape[1:], down.shape[1], down.shape[2]))


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a (M, K) rows grouped by ``offs`` (G,) cumulative ends, b (G, K, N) -> (M, N)."""
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return _ContiguousGrad.apply(fn(a, b, offs=offs))


def sort_by_expert(ids: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Assignments sorted by expert: (order (N*k,) into the flattened ids, token of each (N*k,), group ends (E,)
    int32). Fixed shapes only (counts by scatter_add, no bincount), so no host sync."""
    flat = ids.reshape(-1)  # (N*k,)
    order = torch.argsort(flat, stable=True)  # token order kept within an expert, as HF's loop adds them
    tokens = order // ids.shape[1]
    counts = torch.zeros(num, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    return order, tokens, torch.cumsum(counts, 0, dtype=torch.int32)


def grouped_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    offset: int | None = None,
) -> torch.Tensor:
    """Each token's experts through two grouped GEMMs: x (N, H), ids/weights (N, k), gate_up (E, 2I, H),
    down (E, H, I) -> (N, H), summed per token in expert order.

    ``offset``: gate_up and down hold the model's experts offset .. offset + E - 1 only (a rank of an
    expert-parallel rollout); a token's other experts add nothing here (their ranks add them)."""
    num = gate_up.shape[0]
    keep = None
    if offset is None:
        order, tokens, ends = sort_by_expert(ids, num)
    else:
        local = ids - offset  # (N, k)
        mine = (local >= 0) & (local < num)
        # Another rank's experts sort last, as group ``num``, which no GEMM reads (ends has num entries).
        order, tokens, ends = sort_by_expert(torch.where(mine, local, num), num + 1)
        ends, keep = ends[:num], mine.reshape(-1)[order]  # (E,), (N*k,)
    xs = x[tokens]  # (N*k, H)
    h = _grouped_mm(xs, gate_up.transpose(1, 2), ends)  # (N*k, 2I)
    gate, up = h.chunk(2, dim=-1)
    y = _grouped_mm(F.silu(gate) * up, down.transpose(1, 2), ends)  # (N*k, H)
    y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
    if keep is not None:  # rows past the last group were never written: select, never multiply, them away
        y = torch.where(keep[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    return torch.zeros_like(x).index_add_(0, tokens, y)


def loop_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    offset: int | None = None,
) -> torch.Tensor:
    """The reference: a loop over experts with the tokens routed to each (HF's eager order), same shapes
    (``offset`` as ``grouped_experts``: these are experts offset .. offset + E - 1 of the model)."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(ids == e + (offset or 0))
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def run_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """``grouped_experts`` where grouped GEMMs run for these shapes, else ``loop_experts``."""
    fits = grouped_mm_fits(x, gate_up, down) and gate_up.dtype == x.dtype
    return (grouped_experts if fits else loop_experts)(x, ids, weights, gate_up, down)


@dataclass
class RouterRecord:
    """What a block's last forward routed: logits (N, E) (graph-connected, for the auxiliary loss), the ids
    used (N, k), the router's own choice (N, k) and the replayed ids (N, k) (None without replay)."""

    logits: torch.Tensor
    ids: torch.Tensor
    own: torch.Tensor
    replay: torch.Tensor | None = None


class MoEBlock(nn.Module):
    """A HF sparse MoE block's forward through ``route`` and ``run_experts``, on the HF block's own submodules.

    The parameters keep their HF names (``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``, the
    shared expert's), so checkpoints and exports are unchanged. ``replay`` (N, k), when set, fixes the experts
    (router replay); ``record`` keeps the last forward's routing (auxiliary loss, metrics).
    ``experts_fn`` is the experts' computation; expert parallelism swaps in its dispatching version.
    """

    def __init__(self, hf_block: nn.Module, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        for name, child in hf_block.named_children():  # HF's order, so parameters list as before
            self.add_module(name, child)
        self.jitter = float(getattr(hf_block, "jitter_noise", 0.0) or 0.0)
        self.replay: torch.Tensor | None = None
        self.record: RouterRecord | None = None
        self.keep_record = False
        self.experts_fn = run_experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (b, t, H) -> (b, t, H)."""
        shape = hidden.shape
        if self.training and self.jitter > 0:  # Mixtral's multiplicative router jitter, training only
            hidden = hidden * torch.empty_like(hidden).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        x = hidden.reshape(-1, shape[-1])  # (N, H)
        logits = router_logits(x, self.gate.weight, self.spec)  # (N, E)
        bias = getattr(self.gate, "e_score_correction_bias", None)
        weights, ids, own = route_and_choose(logits, self.spec, bias, self.replay)
        if self.keep_record:
            self.record = RouterRecord(logits, ids, own, self.replay)
        out = self.experts_fn(x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj)
        out = out + self._shared(x)
        return out.reshape(shape)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | float:
        """The shared expert's output: Qwen2-MoE's sigmoid-gated one, DeepSeek's plain ones, or 0."""
        if hasattr(self, "shared_expert"):
            return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if hasattr(self, "shared_experts"):
            return self.shared_experts(x)
        return 0.0


def is_sparse_block(module: nn.Module) -> bool:
    """Whether ``module`` is a HF sparse MoE block in transformers 5's layout (a router and fused experts)."""
    experts = getattr(module, "experts", None)
    return (
        hasattr(getattr(module, "gate", None), "weight")
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
    )


def install_moe(model: nn.Module) -> int:
    """Swap every HF sparse MoE block of ``model`` for a ``MoEBlock`` in place; returns how many."""
    spec = router_spec(getattr(model, "config", None))
    if spec is None:
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_sparse_block(child) and not isinstance(child, MoEBlock):
                parent.add_module(name, MoEBlock(child, spec))
                swapped += 1
    return swapped


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's MoE blocks in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def set_replay(model: nn.Module, ids: torch.Tensor | None) -> None:
    """Fix every MoE block's experts to ``ids`` (N, L, k), L the model's MoE blocks in order; None clears."""
    blocks = moe_blocks(model)
    if ids is not None and ids.shape[1] != len(blocks):
        raise ValueError(f"replay ids cover {ids.shape[1]} MoE layers; the model has {len(blocks)}")
    for i, block in enumerate(blocks):
        block.replay = None if ids is None else ids[:, i]


def keep_records(model: nn.Module, on: bool) -> None:
    """Make every MoE block keep (or drop) its last forward's routing."""
    for block in moe_blocks(model):
        block.keep_record, block.record = on, None


def records(model: nn.Module) -> list[RouterRecord]:
    """The kept routing of each MoE block's last forward (blocks that kept none are left out)."""
    return [b.record for b in moe_blocks(model) if b.record is not None]


def load_balancing_loss(
    logits: list[torch.Tensor], top_k: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss as transformers computes it: over all layers' tokens at once,
    E * sum_e (fraction of assignments to e) * (mean router probability of e). logits: per layer (N, E);
    ``mask`` (N,) keeps the real tokens."""
    stacked = torch.cat([x.float() for x in logits])  # (L*N, E)
    num = stacked.shape[-1]
    probs = torch.softmax(stacked, dim=-1)
    chosen = F.one_hot(torch.topk(probs, top_k, dim=-1)[1], num).float()  # (L*N, k, E)
    if mask is None:
        tokens_per_expert = chosen.mean(0)  # (k, E)
        prob_per_expert = probs.mean(0)  # (E,)
    else:
        keep = mask.float().repeat(len(logits))  # (L*N,)
        total = keep.sum().clamp_min(1.0)
        tokens_per_expert = (chosen * keep[:, None, None]).sum(0) / total
        prob_per_expert = (probs * keep[:, None]).sum(0) / total
    return (tokens_per_expert * prob_per_expert[None]).sum() * num
