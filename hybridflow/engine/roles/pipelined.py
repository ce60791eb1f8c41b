"""What the roles share to run a pipeline-parallel training view: the runner of a stage, the heads, the inputs.

``parallel.parallelize`` cut the model down to this rank's stage. The roles (``ActorEngine``,
``CriticEngine``) build their micro-batches as under any other view; with pipeline stages their runner
(``runner.PipelinedRunner``) hands them to ``parallel.pipeline.PipelineRunner`` instead of calling their module
once per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybridflow.engine.ops.lm_head import score_hidden_states
from hybridflow.engine.ops.packing import ScoringInputs, build_scoring_inputs, scatter_to_responses
from hybridflow.engine.parallel.parallelize import Stage
from hybridflow.engine.parallel.pipeline import Head, PipelineRunner
from hybridflow.engine.train.train_engine import TrainEngine
from hybridflow.protocol import Batch


def pipeline_runner(engine: TrainEngine, stage: Stage | None, hidden_size: int) -> PipelineRunner | None:
    """The runner of ``engine``'s pipeline stage (None: one stage)."""
    if stage is None:
        return None
    dims = engine.dims
    hidden = (hidden_size, engine.compute_dtype)
    return PipelineRunner(engine.module, stage.index, dims.pp, dims.pp_group, engine.device, hidden)


def policy_head(temperature: float, with_entropy: bool, entropy_grad: bool, fused: bool) -> Head:
    """The last stage's head of a causal LM: log-probs (M,), and entropy (M,) when asked."""

    def head(model: nn.Module, rows: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logp, ent = score_hidden_states(
            rows,
            model.get_output_embeddings(),
            labels,
            temperature,
            with_entropy,
            entropy_grad=entropy_grad,
            fused=fused,
        )
        return (logp,) if ent is None else (logp, ent)

    return head


def value_head(model: nn.Module, rows: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The last stage's head of a value model: one value (M,) per scored position (the labels unused)."""
    return (model.score(rows).float().squeeze(-1),)


def packed_inputs(batch: Batch, parts: Sequence[Sequence[int]]) -> list[ScoringInputs]:
    """The packed scoring inputs (host tensors) of each micro-batch of ``batch``."""
    R = batch["responses"].shape[1]
    out = []
    for idx in parts:
        mb = batch[list(idx)]
        out.append(build_scoring_inputs(mb["input_ids"], mb["attention_mask"], mb["position_ids"], R, True))
    return out


def to_responses(
    out: torch.Tensor, inputs: ScoringInputs, rows: int, response_length: int
) -> list[torch.Tensor]:
    """Each of the head's outputs (k, M) of one micro-batch placed as (rows, R) responses."""
    index = inputs.scatter_index.to(out.device)
    return [scatter_to_responses(o, index, rows, response_length) for o in out]
