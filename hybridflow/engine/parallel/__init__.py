"""Parallel layouts of the actor: the generation view, the tensor-parallel rollout shards and the reshard plan.

DESIGN.md section 4. The training view is FSDP2 over all W ranks (``engine.fsdp``); the generation view
splits the W ranks into W/tp rollout groups of tp ranks (``GenerateView``). ``tp_rollout`` says which slice
of each weight a rollout rank holds and builds its shard of the model; ``plan`` computes, once, which slice of
which parameter each rank receives from which rank; ``resharder`` moves exactly those bytes at every switch.
"""

from hybridflow.engine.parallel.plan import ReshardPlan, Transfer
from hybridflow.engine.parallel.view import GenerateView

__all__ = ["GenerateView", "ReshardPlan", "Transfer"]
