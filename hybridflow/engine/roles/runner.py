"""One micro-batch runner for every role: a sequential and a pipelined implementation behind one interface.

A role splits its batch into micro-batches (row indices) and says what a pass computes (``LogProbs`` for the
actor and the reference, ``Values`` for the critic); the runner does the rest the same way for every role:

- ``forward``: the k per-response results (B, R) in the batch's order, on every rank of the replica;
- ``backward``: one forward and backward per micro-batch, gradients accumulating for one optimizer step,
  each micro-batch's loss from the role's callback, which also hands back metric contributions; the runner
  sums those on the device (float64) and can keep the first output (an on-policy update's log-probs);
- ``reduce_sums``: the sums over the data-parallel ranks, one host copy per call, as the last stage has them.

``SequentialRunner`` calls the role's module once per micro-batch. ``PipelinedRunner`` hands the
micro-batches to ``parallel.pipeline.PipelineRunner`` (GPipe forward, 1F1B update): the losses run on the
last stage, and its results reach the other stages through ``from_last`` / ``tensor_from_last`` (identities
in the sequential runner). ``make_runner`` picks one when the role is built, so no role branches on it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from hybridflow.engine.ops.packing import ScoringInputs, build_scoring_inputs, scatter_to_responses
from hybridflow.engine.ops.vision_inputs import with_images
from hybridflow.engine.parallel.pipeline import Head, PipelineRunner
from hybridflow.engine.roles.pipelined import packed_inputs, policy_head, to_responses, value_head
from hybridflow.engine.train.micro_batch import restore_order
from hybridflow.engine.train.train_engine import TrainEngine
from hybridflow.models.moe import NO_EXPERT, records
from hybridflow.models.vision_tower import vision_spec
from hybridflow.protocol import Batch
from hybridflow.utils.dist import all_reduce_sum

Parts = Sequence[Sequence[int]]  # the micro-batches: row indices into the batch
# (micro-batch on the host, its k outputs (b, R) on the device) -> (loss, metric contributions to sum)
MicroLoss = Callable[[Batch, list[torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Outputs(Protocol):
    """What a pass computes per scored token: ``k`` outputs, from the whole module or the last stage's head."""

    k: int

    def of_module(self, module: nn.Module, inputs: ScoringInputs) -> list[torch.Tensor]:
        """The k outputs (M,) of the role's whole (one-stage) scorer module."""
        ...

    def stage_head(self) -> Head:
        """The same outputs computed by the last pipeline stage from its hidden rows."""
        ...


@dataclass(frozen=True)
class LogProbs:
    """Log-probs of the response tokens at ``logits / temperature``, then their entropy when asked."""

    temperature: float = 1.0
    with_entropy: bool = False
    entropy_grad: bool = True  # False: the entropy is a metric only (no backward through it)
    fused: bool = True  # the fused LM-head kernels (False: the checkpointed reference path)

    @property
    def k(self) -> int:
        """One output (log-probs), two with the entropy."""
        return 2 if self.with_entropy else 1

    def of_module(self, module: nn.Module, inputs: ScoringInputs) -> list[torch.Tensor]:
        """``PolicyScorer``'s log-probs (M,) and entropy (M,)."""
        logp, ent = module(inputs, self.temperature, self.with_entropy, self.entropy_grad)
        return [logp] if ent is None else [logp, ent]

    def stage_head(self) -> Head:
        """The last stage's LM head."""
        return policy_head(self.temperature, self.with_entropy, self.entropy_grad, self.fused)


@dataclass(frozen=True)
class Values:
    """The value of the state before each response token (the critic)."""

    @property
    def k(self) -> int:
        """One output."""
        return 1

    def of_module(self, module: nn.Module, inputs: ScoringInputs) -> list[torch.Tensor]:
        """``ValueScorer``'s values (M,)."""
        return [module(inputs)]

    def stage_head(self) -> Head:
        """The last stage's value head."""
        return value_head


@dataclass
class Collected:
    """What a backward pass's loss callbacks handed back (empty on the pipeline stages before the last)."""

    sums: dict[str, torch.Tensor]  # metric contributions summed over the micro-batches, float64 on the device
    kept: torch.Tensor | None = None  # ``keep``: the first output (B, R), detached, on the host, every stage


class _Collector:
    """The one per-micro-batch step of a backward pass: the role's loss, its metrics summed, the kept output."""

    def __init__(self, loss: MicroLoss, device: torch.device, keep: bool) -> None:
        self.loss, self.device, self.keep = loss, device, keep
        self.sums: dict[str, torch.Tensor] = {}
        self.kept: list[torch.Tensor] = []  # (b, R) per micro-batch, in the order they ran

    def __call__(self, mb: Batch, outs: list[torch.Tensor]) -> torch.Tensor:
        """Micro-batch ``mb``'s loss from its outputs (b, R) each."""
        value, metrics = self.loss(mb, outs)
        for key, metric in metrics.items():  # float64 sums on the device: no host sync per micro-batch
            metric = torch.as_tensor(metric, device=self.device).detach().double()
            self.sums[key] = self.sums[key] + metric if key in self.sums else metric
        if self.keep:
            self.kept.append(outs[0].detach())
        return value


class MicroBatchRunner(ABC):
    """Forward and backward passes over micro-batches for one role's engine (the module docstring)."""

    def __init__(self, engine: TrainEngine) -> None:
        self.engine = engine

    @abstractmethod
    def forward(self, batch: Batch, parts: Parts, outputs: Outputs) -> list[torch.Tensor]:
        """The k results (B, R) of a forward-only pass on the device, in ``batch``'s order, on every rank."""

    @abstractmethod
    def _backward(self, batch: Batch, parts: Parts, outputs: Outputs, step: _Collector) -> None:
        """Forward and backward of every micro-batch in order, ``step(mb, outputs)`` giving its loss."""

    def from_last(self, value: object) -> object:
        """``value`` as the last pipeline stage has it (a small Python object)."""
        return value

    def tensor_from_last(
        self, value: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A tensor the last pipeline stage computed (``shape`` and ``dtype`` known to every stage)."""
        assert value is not None
        return value

    def backward(
        self, batch: Batch, parts: Parts, outputs: Outputs, loss: MicroLoss, keep: bool = False
    ) -> Collected:
        """Forward and backward of ``loss(micro_batch, outputs (b, R) each)`` over ``parts`` in order, the
        gradients accumulating for one optimizer step; ``keep``: also return the first output (B, R)."""
        step = _Collector(loss, self.engine.device, keep)
        self._backward(batch, parts, outputs, step)
        kept = None
        if keep:  # every stage takes part; only the last one ran the losses
            local = restore_order(step.kept, parts) if step.kept else None  # (B, R)
            shape = (len(batch), batch["responses"].shape[1])
            kept = self.tensor_from_last(local, shape, torch.float32).cpu()
        return Collected(step.sums, kept)

    def reduce_sums(self, sums: dict[str, torch.Tensor], keys: Sequence[str] = ()) -> dict[str, float]:
        """``sums`` added over the data-parallel ranks (one host copy), as the last stage has them.

        ``keys``: names always reduced (0 where this rank has no contribution), so that every rank of the
        data-parallel group joins the all-reduce whatever its share held.
        """
        names = sorted(set(sums) | set(keys))
        out = {}
        if names:  # none on the pipeline stages before the last (every rank of their dp group alike)
            zero = torch.zeros((), dtype=torch.float64, device=self.engine.device)
            local = torch.stack([sums.get(k, zero) for k in names]).cpu()
            out = dict(zip(names, all_reduce_sum(local, self.engine.dp_group).tolist()))
        return self.from_last(out)


class SequentialRunner(MicroBatchRunner):
    """One stage: the role's module runs each micro-batch whole."""

    def __init__(self, engine: TrainEngine, remove_padding: bool, **accumulation: bool | None) -> None:
        """``remove_padding``: packed inputs; ``accumulation``: ``TrainEngine.accumulate``'s options."""
        super().__init__(engine)
        self.remove_padding = remove_padding
        self.accumulation = accumulation
        scored = getattr(engine.module, "lm", None)  # the policy's model (a value model has no images)
        self.vision = vision_spec(scored.config) if scored is not None else None

    def outputs(self, mb: Batch, outputs: Outputs) -> list[torch.Tensor]:
        """The k outputs (b, R) of micro-batch ``mb`` on the device (its scoring indices built on the host)."""
        B, R = mb["responses"].shape
        inputs = build_scoring_inputs(
            mb["input_ids"],
            mb["attention_mask"],
            mb["position_ids"],
            R,
            self.remove_padding,
            mb.get("routed_experts"),  # MoE router replay, when the batch carries it
        )
        if self.vision is not None:  # a VLM: the rows' images and M-RoPE positions
            inputs = with_images(inputs, mb, self.vision)
        inputs = inputs.to(self.engine.device)
        per_token = outputs.of_module(self.engine.module, inputs)  # k x (M,)
        return [scatter_to_responses(o, inputs.scatter_index, B, R) for o in per_token]  # k x (B, R)

    def forward(self, batch: Batch, parts: Parts, outputs: Outputs) -> list[torch.Tensor]:
        """The k results (B, R) on the device, in ``batch``'s order (see ``MicroBatchRunner.forward``)."""
        per_part = [self.outputs(batch[list(idx)], outputs) for idx in parts]  # stay on the device
        return [restore_order([p[j] for p in per_part], parts) for j in range(outputs.k)]

    def forward_routed(
        self, batch: Batch, parts: Parts, outputs: Outputs
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``forward``, and the experts each token of ``batch`` ran (B, T, L, k) uint8 on the host (255:
        padding), from the MoE blocks' records (router replay R2: the old policy's routing)."""
        per_part, routed = [], []
        for idx in parts:
            mb = batch[list(idx)]
            per_part.append(self.outputs(mb, outputs))
            routed.append(self._routing(mb).cpu())
        results = [restore_order([p[j] for p in per_part], parts) for j in range(outputs.k)]
        return results, restore_order(routed, parts)

    def _routing(self, mb: Batch) -> torch.Tensor:
        """The last forward's experts laid out as ``mb``'s tokens: (b, T, L, k) uint8, 255 at padding."""
        recs = records(self.engine.module.lm)
        ids = torch.stack([r.ids for r in recs], 1).to(torch.uint8)  # (N, L, k) packed or padded rows
        b, T = mb["input_ids"].shape
        real = mb["attention_mask"].reshape(-1).bool().to(ids.device)  # (b * T,)
        out = torch.full((b * T, *ids.shape[1:]), NO_EXPERT, dtype=torch.uint8, device=ids.device)
        out[real] = ids if self.remove_padding else ids[real]
        return out.view(b, T, *ids.shape[1:])

    def _backward(self, batch: Batch, parts: Parts, outputs: Outputs, step: _Collector) -> None:
        for i, idx in enumerate(parts):
            mb = batch[list(idx)]  # stays on the host: the scoring indices are built there
            value = step(mb, self.outputs(mb, outputs))
            self.engine.accumulate(i, len(parts), **self.accumulation)
            value.backward()


class PipelinedRunner(MicroBatchRunner):
    """This rank's pipeline stage: the micro-batches go through ``PipelineRunner`` with the other stages."""

    def __init__(self, engine: TrainEngine, pipeline: PipelineRunner) -> None:
        super().__init__(engine)
        self.pipeline = pipeline

    def forward(self, batch: Batch, parts: Parts, outputs: Outputs) -> list[torch.Tensor]:
        """The k results (B, R) on the device, in ``batch``'s order, on every stage (GPipe)."""
        inputs = packed_inputs(batch, parts)
        outs = self.pipeline.forward(inputs, outputs.stage_head(), outputs.k)  # None before the last stage
        k, R = outputs.k, batch["responses"].shape[1]
        stacked = None
        if outs is not None:  # the last stage: (k, B, R)
            per_part = [to_responses(o, x, len(p), R) for o, x, p in zip(outs, inputs, parts)]
            stacked = torch.stack([restore_order([pp[j] for pp in per_part], parts) for j in range(k)])
        return list(self.tensor_from_last(stacked, (k, len(batch), R), torch.float32))

    def _backward(self, batch: Batch, parts: Parts, outputs: Outputs, step: _Collector) -> None:
        inputs = packed_inputs(batch, parts)
        R = batch["responses"].shape[1]

        def loss_of(i: int, out: torch.Tensor) -> torch.Tensor:  # out (k, M_i), on the last stage
            return step(batch[list(parts[i])], to_responses(out, inputs[i], len(parts[i]), R))

        self.pipeline.train(inputs, outputs.stage_head(), outputs.k, loss_of)

    def from_last(self, value: object) -> object:
        """``value`` as the last stage has it, on every stage."""
        return self.pipeline.from_last(value)

    def tensor_from_last(
        self, value: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """The last stage's tensor on every stage (on the device)."""
        return self.pipeline.tensor_from_last(value, shape, dtype)


def make_runner(
    engine: TrainEngine,
    pipeline: PipelineRunner | None,
    remove_padding: bool,
    **accumulation: bool | None,
) -> MicroBatchRunner:
    """The runner of a role's engine: pipelined when it has pipeline stages, else sequential.

    ``accumulation``: ``TrainEngine.accumulate``'s options (``defer_grad_sync``, ``keep_params_gathered``)
    for the sequential runner's micro-batches; the pipeline schedule accumulates in the stage's parameters.
    """
    if pipeline is not None:
        return PipelinedRunner(engine, pipeline)
    return SequentialRunner(engine, remove_padding, **accumulation)
