"""Parallel layouts of the actor: the generation view, the tensor-parallel rollout shards and the reshard plan.

DESIGN.md section 4. The training view (``TrainView``) puts a role's W ranks on a (pp, tp, dp) mesh: FSDP2
over dp (``engine.fsdp``), DTensor tensor parallelism inside the layers over tp (``tp_train``), pipeline
stages not yet; ``grad_norm`` clips by the norm across its meshes. The generation view splits the W ranks
into W/tp rollout groups of tp ranks (``GenerateView``). ``tp_rollout`` says which slice of each weight a
rollout rank holds and builds its shard of the model; ``plan`` computes, once, which slice of which parameter
each rank receives from which rank; ``resharder`` moves exactly those bytes at every switch.
"""

from hybridflow.engine.parallel.plan import ReshardPlan, Transfer
from hybridflow.engine.parallel.train_view import TrainView
from hybridflow.engine.parallel.view import GenerateView

__all__ = ["GenerateView", "ReshardPlan", "TrainView", "Transfer"]
