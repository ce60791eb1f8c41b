"""The critic on one rank: values of response states and the clipped value-loss update."""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from hybridflow.algos.aggregation import local_batch_info
from hybridflow.algos.value_loss import compute_value_loss
from hybridflow.config.schema import CriticConfig
from hybridflow.engine.ops.packing import to_device
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.engine.parallel.parallelize import parallelize
from hybridflow.engine.roles.pipelined import pipeline_runner
from hybridflow.engine.roles.runner import Values, make_runner
from hybridflow.engine.train.micro_batch import check_batch, micro_batch_indices
from hybridflow.engine.train.scorer import ValueScorer
from hybridflow.engine.train.train_engine import TrainEngine
from hybridflow.protocol import Batch
from hybridflow.utils.dist import all_reduce_sum
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

SCORING_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


class CriticEngine:
    """FSDP2 value model: ``compute_values`` before the update, ``update_critic`` over mini-batches and epochs."""

    def __init__(
        self,
        value_model: nn.Module,
        critic: CriticConfig,
        *,
        ppo_mini_batch_size: int,
        rollout_n: int = 1,
        use_remove_padding: bool = False,
        gradient_checkpointing: bool = False,
        total_steps: int = 1,
        device: torch.device | None = None,
        dims: ParallelDims | None = None,
    ) -> None:
        """``dims``: the training view (None: FSDP2 over every rank), as ``ActorEngine`` takes it."""
        self.critic = critic
        self.remove_padding = use_remove_padding or (dims is not None and dims.pp > 1)  # stages run packed
        parallel = parallelize(
            value_model,
            dims,
            critic.fsdp,
            trainable=True,
            root=ValueScorer,
            stage_attr="model",
            packed=self.remove_padding,
            checkpointing=gradient_checkpointing,
            compile=critic.use_torch_compile,
            device=device,
        )
        self.engine = TrainEngine(parallel, critic.fsdp, critic.optim, critic.grad_clip, total_steps)
        self.pipeline = pipeline_runner(self.engine, parallel.stage, value_model.config.hidden_size)
        self.runner = make_runner(self.engine, self.pipeline, self.remove_padding)
        dp = self.engine.dp_size
        self.mini_batch_size = ppo_mini_batch_size * rollout_n // dp
        if self.mini_batch_size < 1:
            raise UserError(
                f"critic.ppo_mini_batch_size={ppo_mini_batch_size} x rollout.n={rollout_n} is smaller than the "
                f"{dp} data-parallel ranks; raise ppo_mini_batch_size"
            )

    @property
    def module(self) -> nn.Module:
        """The FSDP2-wrapped ``ValueScorer``."""
        return self.engine.module

    @property
    def dims(self) -> ParallelDims:
        """The training view, with its process groups."""
        return self.engine.dims

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values (B, R) of the states before each response token (0 where there is no token), on CPU."""
        check_batch(batch, SCORING_KEYS)
        self.engine.onload()
        self.module.eval()
        c = self.critic
        parts = micro_batch_indices(
            batch, c.ppo_micro_batch_size_per_gpu, c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu
        )
        (values,) = self.runner.forward(batch, parts, Values())  # (B, R) on the device
        values = values.cpu()
        self.engine.offload()
        return values

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value regression onto ``returns`` for ``ppo_epochs`` passes; returns verl-named metrics."""
        check_batch(batch, (*SCORING_KEYS, "response_mask", "values", "returns"))
        self.engine.onload()
        self.module.train()
        history: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.critic.ppo_epochs):
            for mini in batch.split(self.mini_batch_size):
                for key, value in self._update_mini_batch(mini).items():
                    history[key].append(value)
        self.engine.lr_step()
        self.engine.offload()
        metrics = {key: sum(v) / len(v) for key, v in history.items()}
        metrics["critic/lr"] = self.engine.lr
        metrics["critic/skipped_steps"] = self.engine.skipped_steps  # non-finite grad norms so far
        return metrics

    def _update_mini_batch(self, mini: Batch) -> dict[str, float]:
        c = self.critic
        dp, group = self.engine.dp_size, self.engine.dp_group
        counts = {
            k: int(all_reduce_sum(v, group)) for k, v in local_batch_info(mini["response_mask"]).items()
        }
        dev = self.engine.device
        parts = micro_batch_indices(
            mini, c.ppo_micro_batch_size_per_gpu, c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu
        )
        tokens = max(counts["batch_num_tokens"], 1)

        def loss(mb: Batch, outs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            (vpreds,) = outs  # (b, R)
            share = float(mb["response_mask"].sum()) / tokens  # this micro-batch's token share (host)
            mask, returns, values = (to_device(mb[k], dev) for k in ("response_mask", "returns", "values"))
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds, returns, values, mask, c.cliprange_value, c.loss_agg_mode, dp_size=dp, **counts
            )
            return vf_loss, {  # summed on the device by the runner, copied to the host once per mini-batch
                "critic/vf_loss": vf_loss.detach().double() / dp,
                "critic/vf_clipfrac": torch.as_tensor(vf_clipfrac, device=dev).detach().double() * share,
                "critic/vpred_mean": (vpreds.detach() * mask).sum().double() / tokens,
            }

        metrics = self.runner.reduce_sums(self.runner.backward(mini, parts, Values(), loss).sums)
        metrics["critic/grad_norm"] = self.engine.optimizer_step()
        return metrics
