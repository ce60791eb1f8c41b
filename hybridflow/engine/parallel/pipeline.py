"""Pipeline parallelism for training: the decoder layers split into ``pp`` stages, run with PyTorch's schedules.

A stage is the Hugging Face model with only its contiguous run of decoder layers kept (``split_stage``): the
first stage also keeps the embedding, the last the final norm and the head. Layers keep their names
(``model.layers.7`` stays ``model.layers.7`` on the stage that owns it), so checkpoints, exports and the
reshard plan see the same parameter names in every view. A tied head (Qwen2's small models) lives on both
ends: the last stage keeps the embedding module as the owner of the head's weight, the two copies get the
sum of their gradients after every backward (``TiedWeights``), and the global grad norm counts them once.

Every stage runs the packed layout (remove-padding): each micro-batch is one row of tokens, padded to the
pass's longest micro-batch, since ``torch.distributed.pipelining`` sends fixed-shape activations and the
stage's buffers are sized once per pass. The padding is one extra sequence, attended only by itself and
never scored. Every rank of a model replica holds the same rows (the driver's share of it), so each stage
builds the same micro-batches and knows their shapes: the stages are given those shapes (no shape inference
round trip). A forward-only pass (old and reference log-probs, values) runs GPipe's fill-drain; an update
runs 1F1B, each micro-batch's loss computed on the last stage by the caller's function, summed (never
averaged over micro-batches: the losses are already shares of the mini-batch's global token mean).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from hybridflow.config.parallel import size_key
from hybridflow.engine.ops.packed_attention import BOUNDS_KWARG, CU_SEQLENS_KWARG, packed_mask_placeholder
from hybridflow.engine.ops.packing import ScoringInputs
from hybridflow.models.families import check_layer_split
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

# (the stage's model, rows (M, H), labels (M,)) -> per-row outputs, each (M,) float32: log-probs and entropy,
# or values.
Head = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The decoder layers of ``stage``: contiguous, the first stages one longer when ``pp`` does not divide.

    The last stage also runs the head (a large matmul over the vocabulary), so it is never the longer one
    when the split is uneven.
    """
    size, extra = divmod(num_layers, pp)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (1 if stage < extra else 0))


def stage_of_param(name: str, num_layers: int, pp: int, tied: bool) -> tuple[int, ...]:
    """The stages holding parameter ``name`` of the whole model (the tied embedding: the first and last)."""
    parts = name.split(".")
    if "layers" in parts:
        layer = int(parts[parts.index("layers") + 1])
        return tuple(s for s in range(pp) if layer in stage_layers(num_layers, pp, s))
    if "embed_tokens" in parts:
        return (0, pp - 1) if tied and pp > 1 else (0,)
    return (pp - 1,)  # the final norm, the head, a value head


def check_train_pp(config: object, pp: int, role: str = "actor") -> None:
    """Raise UserError naming the field when ``pp`` stages cannot split this model."""
    check_layer_split(config, size_key(role, "pp"), pp, "pipeline parallelism")
    layers = config.num_hidden_layers
    if pp > layers:
        raise UserError(
            f"{size_key(role, 'pp')}={pp} is more than the model's {layers} decoder layers "
            "(num_hidden_layers); use at most one stage per layer"
        )
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if len(kinds) > 1:
        raise UserError(
            f"{size_key(role, 'pp')}={pp}: this model mixes attention kinds across layers ({sorted(kinds)}), "
            "which pipeline stages do not support yet; set pipeline_parallel_size=1"
        )


def ties_head(model: nn.Module) -> bool:
    """Whether ``model``'s output head is its input embedding (a tied LM head; a value model's is not)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


class StageLayers(nn.ModuleList):
    """A stage's decoder layers under their whole-model indices as names (``layers.7`` stays ``layers.7``).

    Iteration and slicing (what the Hugging Face forward does) run over the stage's layers in order.
    """

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __getitem__(self, idx: int | slice) -> nn.Module | nn.ModuleList:
        """By position among the stage's layers (a slice is a plain ``ModuleList``)."""
        layers = list(self._modules.values())
        return nn.ModuleList(layers[idx]) if isinstance(idx, slice) else layers[idx]


def split_stage(lm: nn.Module, pp: int, stage: int) -> None:
    """Keep only ``stage``'s part of the Hugging Face model ``lm`` (in place, before any sharding)."""
    body = getattr(lm, getattr(lm, "base_model_prefix", "model"))
    keep = stage_layers(len(body.layers), pp, stage)
    body.layers = StageLayers({i: body.layers[i] for i in keep})
    first, last = stage == 0, stage == pp - 1
    tied = ties_head(lm)
    if not first and not (last and tied):
        body.embed_tokens = None
    if not last:
        body.norm = nn.Identity()
        if hasattr(lm, "lm_head"):
            lm.lm_head = None
        if hasattr(lm, "score"):
            lm.score = None


class StageGrid(Protocol):
    """What the tied weights need of a training view (``dims.ParallelDims``): its sizes and coordinates."""

    tp: int
    pp: int

    @property
    def dp(self) -> int: ...

    def coords(self, rank: int) -> tuple[int, int, int]: ...


class TiedWeights:
    """The tied embedding/head weight held by the first and the last stage: their gradients summed."""

    def __init__(self, lm: nn.Module, view: StageGrid, rank: int, tied: bool) -> None:
        """``tied``: whether ``lm``'s head was tied to its embedding (``ties_head`` before the split)."""
        self.embedding: nn.Module | None = (
            None  # holds the weight (looked up at each use: offload may swap it)
        )
        self.group = None
        self.counted = True  # whether this copy counts in the grad norm (the first stage's does)
        if view.pp == 1 or not tied:
            return
        stage, tp_rank, dp_rank = view.coords(rank)
        width = view.tp * view.dp  # ranks per stage
        for t in range(view.tp):  # new_group is collective over the world: every rank creates every pair
            for d in range(view.dp):
                group = dist.new_group([t * view.dp + d, (view.pp - 1) * width + t * view.dp + d])
                if (t, d) == (tp_rank, dp_rank):
                    self.group = group
        if stage in (0, view.pp - 1):
            self.embedding = getattr(lm, getattr(lm, "base_model_prefix", "model")).embed_tokens
            self.counted = stage == 0

    @property
    def param(self) -> nn.Parameter | None:
        """This stage's copy of the tied weight (None: the stage holds none)."""
        return None if self.embedding is None else self.embedding.weight

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the two copies' gradients (each rank's local shard: both ends shard the weight alike)."""
        param = self.param
        if param is None:
            return
        if param.grad is None:  # no token reached this copy: the other one still waits for a sum
            param.grad = torch.zeros_like(param)
        grad = param.grad
        dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.group)


@dataclass
class PassInputs:
    """One pipelined pass: its micro-batches, padded to one shape, and what the last stage computes."""

    parts: list[ScoringInputs]  # padded to ``tokens`` each
    rows: list[int]  # the real scored rows of each micro-batch
    tokens: int  # the padded length of every micro-batch


def pad_packed(inputs: ScoringInputs, tokens: int) -> ScoringInputs:
    """Packed inputs (1, S) padded to (1, ``tokens``) by one extra sequence that nothing scores."""
    pad = tokens - inputs.input_ids.shape[1]
    if pad == 0:
        return inputs
    assert inputs.seq_bounds is not None and pad > 0, "pipeline stages run packed micro-batches"
    ids = torch.cat([inputs.input_ids, inputs.input_ids.new_zeros(1, pad)], 1)  # (1, tokens)
    positions = torch.cat([inputs.position_ids, torch.arange(pad, dtype=inputs.position_ids.dtype)[None]], 1)
    bounds = [*inputs.seq_bounds, tokens]
    return replace(
        inputs,
        input_ids=ids,
        position_ids=positions,
        seq_bounds=bounds,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
    )


def plan_pass(parts: list[ScoringInputs]) -> PassInputs:
    """The micro-batches of one pass padded to the longest of them."""
    tokens = max(p.input_ids.shape[1] for p in parts)
    return PassInputs([pad_packed(p, tokens) for p in parts], [p.labels.numel() for p in parts], tokens)


class StageScorer(nn.Module):
    """The root module FSDP2 wraps on one stage: its layers, plus the embedding (first) or head (last).

    ``forward(x)`` takes the token ids (1, S) on the first stage and the previous stage's hidden states
    (1, S, H) elsewhere; it returns hidden states (1, S, H), or on the last stage the head's per-row outputs
    stacked and padded to the pass's most rows (k, M_max). The micro-batch's indices come from ``feed``
    (every stage runs its micro-batches in order in the schedules used here).
    """

    def __init__(self, model: nn.Module, stage: int, pp: int, attr: str = "lm") -> None:
        """``attr``: the name the model is held under, as the one-stage root names it (``PolicyScorer.lm``,
        ``ValueScorer.model``), so parameter names are the same in every view."""
        super().__init__()
        setattr(self, attr, model)
        self._attr = attr
        self.first, self.last = stage == 0, stage == pp - 1
        self.head: Head | None = None
        self._pass: PassInputs | None = None
        self._next = 0
        self._max_rows = 0

    def feed(self, plan: PassInputs, device: torch.device, head: Head) -> None:
        """Set the micro-batches of the coming pass (their indices moved to ``device``) and the last stage's
        head: ``head(model, rows (M, H), labels (M,))`` returns per-row outputs, each (M,) float32."""
        self.head = head
        self._pass = replace(plan, parts=[p.to(device) for p in plan.parts])
        self._next, self._max_rows = 0, max(plan.rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One micro-batch through this stage (see the class docstring for the shapes)."""
        assert self._pass is not None and self._next < len(self._pass.parts), "feed() the pass first"
        inputs = self._pass.parts[self._next]
        self._next += 1
        model = getattr(self, self._attr)
        body = getattr(model, getattr(model, "base_model_prefix", "model"))
        ids, embeds = (x, None) if self.first else (None, x)
        out = body(
            input_ids=ids,
            inputs_embeds=embeds,
            attention_mask=packed_mask_placeholder(x.device),
            position_ids=inputs.position_ids,
            use_cache=False,
            **{BOUNDS_KWARG: torch.tensor(inputs.seq_bounds), CU_SEQLENS_KWARG: inputs.cu_seqlens},
        )
        hidden = out.last_hidden_state  # (1, S, H)
        if not self.last:
            return hidden
        rows = hidden[0].index_select(0, inputs.gather_index)  # (M, H)
        outputs = self.head(model, rows, inputs.labels)  # k x (M,)
        stacked = torch.stack(outputs)  # (k, M)
        return nn.functional.pad(stacked, (0, self._max_rows - stacked.shape[1]))  # (k, M_max)


class PipelineRunner:
    """Runs passes of micro-batches through this rank's stage with the other stages of its replica."""

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        pp: int,
        group: dist.ProcessGroup,
        device: torch.device,
        hidden: tuple[int, torch.dtype],
    ) -> None:
        """``module``: the FSDP2-wrapped ``StageScorer``; ``group``: the ranks of this rank's pipeline (one
        per stage); ``hidden``: the hidden size and the dtype activations travel in."""
        self.module, self.stage, self.pp, self.group, self.device = module, stage, pp, group, device
        self.hidden_size, self.dtype = hidden
        self.last_rank = dist.get_global_rank(group, pp - 1)

    @property
    def scorer(self) -> StageScorer:
        """The stage module (FSDP2's root wraps it in place)."""
        return self.module

    def _stage(self, plan: PassInputs, outputs: int, backward: bool) -> PipelineStage:
        """This rank's stage for one pass, given every shape (the stages' metadata: no inference round trip;
        a received activation needs its gradient exactly when the pass has a backward)."""
        S, H = plan.tokens, self.hidden_size
        meta = torch.device("meta")
        if self.stage == 0:
            inputs = torch.empty(1, S, dtype=torch.long, device=meta)
        else:
            inputs = torch.empty(1, S, H, dtype=self.dtype, device=meta, requires_grad=backward)
        if self.stage == self.pp - 1:
            out = torch.empty(
                outputs, max(plan.rows), dtype=torch.float32, device=meta, requires_grad=backward
            )
        else:
            out = torch.empty(1, S, H, dtype=self.dtype, device=meta, requires_grad=backward)
        return PipelineStage(
            self.module,
            self.stage,
            self.pp,
            self.device,
            input_args=inputs,
            output_args=out,
            group=self.group,
        )

    def _ids(self, plan: PassInputs) -> tuple[torch.Tensor, ...]:
        if self.stage != 0:
            return ()
        return (
            torch.cat([p.input_ids for p in plan.parts]).to(self.device),
        )  # (n, S): one row per micro-batch

    def forward(self, parts: list[ScoringInputs], head: Head, outputs: int) -> list[torch.Tensor] | None:
        """Forward-only pass; on the last stage the head's ``outputs`` rows (k, M_i) of each micro-batch, else
        None."""
        plan = plan_pass(parts)
        self.scorer.feed(plan, self.device, head)
        schedule = ScheduleGPipe(self._stage(plan, outputs, False), len(parts))
        merged = schedule.eval(*self._ids(plan))
        if self.stage != self.pp - 1:
            return None
        chunks = merged.split(outputs)  # n x (k, M_max)
        return [c[:, :m] for c, m in zip(chunks, plan.rows)]

    def train(
        self,
        parts: list[ScoringInputs],
        head: Head,
        outputs: int,
        loss_of: Callable[[int, torch.Tensor], torch.Tensor],
    ) -> None:
        """Forward and backward of every micro-batch (1F1B); ``loss_of(i, out (k, M_i))`` runs on the last
        stage and returns micro-batch i's loss. Gradients accumulate in the stage's parameters."""
        plan = plan_pass(parts)
        self.scorer.feed(plan, self.device, head)

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            i = int(target)
            return loss_of(i, output[:, : plan.rows[i]])

        schedule = Schedule1F1B(
            self._stage(plan, outputs, True), len(parts), loss_fn=loss_fn, scale_grads=False
        )
        target = torch.arange(len(parts)) if self.stage == self.pp - 1 else None
        schedule.step(*self._ids(plan), target=target, return_outputs=False)

    def from_last(self, value: object) -> object:
        """``value`` as the last stage has it, on every stage of the pipeline (a small Python object)."""
        box = [value]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0]

    def tensor_from_last(
        self, value: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A tensor the last stage computed, on every stage (``shape`` and ``dtype`` known to all)."""
        if self.stage == self.pp - 1:
            assert value is not None
            buf = value.to(self.device, dtype).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buf, src=self.last_rank, group=self.group)
        return buf
