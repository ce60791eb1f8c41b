"""L3: per-rank compute, in rooms with one-way imports (``tests/test_layering.py`` checks them).

- ``ops``: what a forward pass computes with: packing, sequences, packed/varlen attention, the LM head and its
  kernels, dtypes, local shards. Imports no other room.
- ``parallel``: the layouts and how they are applied: the training view (``dims.ParallelDims``) and
  ``parallelize`` (pipeline split, tensor parallelism, Ulysses, compile, FSDP2), the generation view, the
  shard rules (``layout``). Imports ``ops``.
- ``train``: the training engine (optimizer, schedule, clipping, offload), micro-batches and the scorers.
  Imports ``ops`` and ``parallel``.
- ``rollout``: the built-in rollout engine and its tensor-parallel shard. Imports ``ops`` and ``parallel``:
  never training code.
- ``roles``: the actor, critic and preference updates over the training engine. Imports ``ops``, ``parallel``,
  ``train``.
- ``hybrid``: the switch between the two views: the reshard plan, the resharder, the rollout's weights (shard,
  or the baseline's broadcast copy), the stream into a separate rollout pool, the memory account, the world
  line. Imports ``ops``, ``parallel``, ``rollout``.

This package exports the surface the workers and the trainer use; each name is imported on first use, so
``import hybridflow.engine`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module (under hybridflow.engine) that defines it
SURFACE: dict[str, str] = {
    "GRAD_BYTES": "hybrid.memory",
    "MASTER_BYTES": "hybrid.memory",
    "MOMENT_BYTES": "hybrid.memory",
    "ViewMemory": "hybrid.memory",
    "unsplit_reason": "hybrid.memory",
    "view_memory": "hybrid.memory",
    "PoolSync": "hybrid.pool_sync",
    "Bridge": "hybrid.bridge",
    "BroadcastReplica": "hybrid.switch",
    "BUILT_IN_NEEDS": "hybrid.actor",
    "HybridActor": "hybrid.actor",
    "HybridSettings": "hybrid.actor",
    "RolloutShard": "hybrid.switch",
    "world_line": "hybrid.world",
    "to_dtype": "ops.dtypes",
    "fp8_probe": "ops.fp8_probe",
    "pick_kernel": "ops.fp8_probe",
    "FP8_KERNELS": "ops.fp8",
    "use_kernel": "ops.fp8",
    "decoder_of": "ops.modules",
    "layout_padding": "ops.sequences",
    "pack_prompt_response": "ops.sequences",
    "pack_routing": "ops.sequences",
    "pad_rows": "ops.sequences",
    "ParallelDims": "parallel.dims",
    "ShardLayout": "parallel.layout",
    "kind_of": "parallel.layout",
    "stage_of_param": "parallel.pipeline",
    "train_box": "parallel.dims",
    "full_state_dict": "parallel.fsdp",
    "InPlaceMerge": "parallel.lora",
    "LoraSpec": "parallel.lora",
    "adapters_disabled": "parallel.lora",
    "lora_elements": "parallel.lora",
    "lora_modules": "parallel.lora",
    "check_tp": "parallel.layout",
    "follow_rollout_shards": "parallel.layout",
    "default_device": "parallel.parallelize",
    "RolloutGroup": "parallel.rollout_group",
    "GenerateView": "parallel.view",
    "ActorEngine": "roles.actor",
    "CriticEngine": "roles.critic",
    "update_preference": "roles.preference",
    "enable_exact_kernels": "ops.invariant",
    "HFRollout": "rollout.hf_fallback",
    "PagedEngine": "rollout.engine",
    "GroupState": "rollout.partial",
    "AgentLoop": "rollout.agent_loop",
    "Episode": "rollout.agent_loop",
    "LoopLimits": "rollout.agent_loop",
    "ToolTurn": "rollout.agent_loop",
    "SampleState": "rollout.partial",
    "new_group": "rollout.partial",
    "roll_partial": "rollout.partial",
    "make_rollout": "rollout.factory",
    "SamplingParams": "rollout.sampling",
    "fallback_reason": "rollout.support",
    "RolloutTP": "rollout.tp",
    "GenerationOutput": "rollout.types",
    "move_model": "train.offload",
    "TrainEngine": "train.train_engine",
}
__all__ = sorted(SURFACE)


def __getattr__(name: str) -> Any:
    """Import a name of the surface from its module on first use (PEP 562)."""
    if name not in SURFACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{SURFACE[name]}"), name)
    globals()[name] = value
    return value
