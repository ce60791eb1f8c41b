"""Expert parallelism across rollout groups: the token exchange of one MoE layer, and the settling that keeps
the groups of an expert group meeting at every one.

With ``rollout.expert_parallel_size`` = tp x k (k > 1, ``GenerateView.exchanges``) each rank holds E / ep whole
experts, and tensor-parallel rank t of k rollout groups together holds the experts rank t holds at ep = tp.
Those k ranks (``GenerateView.exchange_ranks``) decode different prompts, so at every MoE layer they pool
their tokens: an all-gather of the row counts, an all-gather of the rows (hidden states, expert ids, routing
weights) padded to the largest count, each rank's experts' share for every pooled row, and a reduce-scatter
that hands each rank its own rows summed over the k ranks' experts. The group's all-reduce after the MLP then
adds the other tensor-parallel ranks' experts, exactly as at ep = tp. Routing stays local (each replica's own
router, its ids recorded for router replay as before).

Each forward of a replica runs one exchange per MoE layer, so the k ranks' forwards pair up one to one,
whatever each is (a prefill chunk, a decode step): no other lockstep is needed while every replica has work.
A replica that has finished keeps answering with no rows (``settle``: a flag instead of its count) until
every replica of its expert group has finished, so that the last ones' forwards still find their peers.

The row counts are needed on the host (the padding), one sync per MoE layer: fine on CPU with gloo, not
inside a CUDA graph. The GPU path is refused for now (``check_device``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

# The functional all-gather and reduce-scatter of one tensor (as ``rollout.tp``: the *_single names where torch
# has them; 2.13 deprecates the *_tensor ones with a warning per call).
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
IDLE = -1  # a settling rank's count: it has no forward of its own, only its peers' rows to serve
Experts = Callable[..., torch.Tensor]


def check_device(device: torch.device, tp: int) -> None:
    """The exchange syncs the host at every MoE layer: refuse it off CPU (UserError naming the fix)."""
    if device.type != "cpu":
        raise UserError(
            "expert parallelism across rollout groups runs on CPU/gloo only so far; set "
            f"rollout.expert_parallel_size={tp}"
        )


class ExpertExchange:
    """This rank's place among the k ranks pooling their tokens at every MoE layer (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int, expert_rank: int) -> None:
        """``group``: the k exchange ranks (``parallel.view.exchange_group``), this rank's index in it its
        rollout group's place in the expert group; ``num_experts``: the model's routed experts (E);
        ``expert_rank``: this rank's (``GenerateView.ep_rank``): it holds experts expert_rank * E / ep on."""
        self.group, self.expert_rank = group, expert_rank
        self.size = dist.get_world_size(group)
        self.index = dist.get_rank(group)
        self.num_experts = num_experts
        self.idle = False
        self.all_idle = False  # the last exchange found every rank settling
        self.exchanges = 0  # MoE-layer exchanges this rank took part in (for the tests and the logs)

    def wrap(self, local: Experts) -> Experts:
        """An experts function (x, ids, weights, gate_up, down) -> (N, hidden) running ``local`` (this rank's
        experts, offset) on the rows of every rank of the exchange."""

        def exchanged(x, ids, weights, gate_up, down):
            return self.run(x, ids, weights, gate_up, down, local)

        exchanged.exchange = self  # type: ignore[attr-defined]
        return exchanged

    def run(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        local: Experts,
    ) -> torch.Tensor:
        """x (N, H), ids/weights (N, k) of this rank's tokens -> (N, H): every expert of the k ranks' summed."""
        self.exchanges += 1
        n = x.shape[0]
        mine = torch.tensor([IDLE if self.idle else n], dtype=torch.int64)
        counts = funcol.wait_tensor(_all_gather(mine, 0, self.group)).tolist()  # the host sync
        self.all_idle = all(c == IDLE for c in counts)
        rows = max(max(counts), 0)
        if self.all_idle or rows == 0:
            return torch.zeros_like(x)
        pad = rows - n
        x_all = self._gather(torch.nn.functional.pad(x, (0, 0, 0, pad)))  # (k * rows, H)
        # padding rows route to no rank's expert (id E) with weight 0: they add nothing anywhere
        ids_all = self._gather(torch.nn.functional.pad(ids, (0, 0, 0, pad), value=self.num_experts))
        # float32 on the wire (idle ranks cannot know a family's weights' dtype); back exactly after
        w_all = self._gather(torch.nn.functional.pad(weights.float(), (0, 0, 0, pad))).to(weights.dtype)
        y = local(x_all, ids_all, w_all, gate_up, down)  # (k * rows, H): this rank's experts' share
        out = funcol.wait_tensor(_reduce_scatter(y.contiguous(), "sum", 0, self.group))
        return out[:n]  # (N, H)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(_all_gather(t.contiguous(), 0, self.group))

    def settle(self, serve_round: Callable[[], None], moe_layers: int) -> int:
        """Serve the peers' forwards with no rows of this rank's until every rank of the exchange has settled
        (called by each when its work is done); returns the rounds served. ``serve_round`` runs one
        forward's MoE layers on empty input; the first exchange of a round tells whether all have settled."""
        if moe_layers == 0:
            return 0
        self.idle, rounds = True, 0
        try:
            while True:
                serve_round()
                if self.all_idle:
                    return rounds
                rounds += 1
        finally:
            self.idle = self.all_idle = False


def serve_layers(
    exchange: ExpertExchange, layers: Sequence, hidden: int, dtype: torch.dtype, device: torch.device
) -> Callable[[], None]:
    """One forward's MoE layers (``blocks.MoEWeights``, in order) on no tokens: ``settle``'s round. Each
    layer's experts function is called with empty rows; the round stops after its first exchange when every
    rank has settled."""

    def serve() -> None:
        x = torch.empty(0, hidden, dtype=dtype, device=device)
        for moe in layers:
            k = moe.spec.top_k
            ids = torch.empty(0, k, dtype=torch.int64, device=device)
            moe.experts(x, ids, torch.empty(0, k, dtype=dtype, device=device), moe.gate_up, moe.down)
            if exchange.all_idle:
                return

    return serve
