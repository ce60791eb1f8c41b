"""The policy on one rank: response log-probs and the PPO-family update (the reference reuses it, forward-only)."""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from hybridflow.algos.aggregation import agg_loss, local_batch_info
from hybridflow.algos.kl import kl_penalty
from hybridflow.algos.policy_loss import PolicyLossConfig
from hybridflow.algos.registry import get_policy_loss_fn
from hybridflow.config.schema import ActorConfig, FSDPConfig, OptimConfig
from hybridflow.engine.ops.packing import to_device
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.engine.parallel.lora import LoraSpec
from hybridflow.engine.parallel.parallelize import parallelize
from hybridflow.engine.roles.pipelined import pipeline_runner
from hybridflow.engine.roles.router_terms import RouterTerms, aux_loss_coef
from hybridflow.engine.roles.runner import LogProbs, MicroLoss, make_runner
from hybridflow.engine.train.micro_batch import check_batch, micro_batch_indices
from hybridflow.engine.train.scorer import PolicyScorer
from hybridflow.engine.train.train_engine import TrainEngine
from hybridflow.models.moe import moe_blocks
from hybridflow.models.vision import text_config
from hybridflow.models.vision_tower import set_vision_trainable
from hybridflow.protocol import Batch
from hybridflow.utils.dist import all_reduce_sum
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

SCORING_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
# What the policy loss reads on the device (the scoring keys stay on the host).
LOSS_KEYS = ("response_mask", "advantages", "old_log_probs", "ref_log_prob", "rollout_is_weights")


class ActorEngine:
    """FSDP2 policy: ``compute_log_prob`` for old/reference log-probs and ``update_policy`` for PPO epochs."""

    def __init__(
        self,
        lm: nn.Module,
        actor: ActorConfig,
        *,
        rollout_n: int = 1,
        use_remove_padding: bool = False,
        gradient_checkpointing: bool = False,
        total_steps: int = 1,
        trainable: bool = True,
        fsdp: FSDPConfig | None = None,
        device: torch.device | None = None,
        fused_head: bool = True,
        defer_grad_sync: bool | None = None,
        keep_params_gathered: bool | None = None,
        dims: ParallelDims | None = None,
        lora: LoraSpec | None = None,
        freeze_vision_tower: bool = True,
    ) -> None:
        """``dims``: the training view (None: FSDP2 over every rank); the ranks of one model replica must be
        given the same rows (the driver hands them one share, ``workers.dispatch``).

        ``fused_head``: the fused LM-head log-prob (False: the checkpointed reference path). ``lora``: train
        low-rank adapters on a frozen base (``parallel.lora``) instead of every weight. ``freeze_vision_tower``:
        a vision-language model's tower and merger get no gradient and stay out of the optimizer.

        ``defer_grad_sync`` / ``keep_params_gathered``: FSDP2 gradient accumulation over the micro-batches of a
        mini-batch (see ``fsdp.set_accumulation``); None turns them on at world size 1 without parameter
        offload, where they cost no extra communication and little memory.
        """
        self.actor = actor
        self.rollout_n = rollout_n
        self.last_log_probs: torch.Tensor | None = None  # an on-policy update's own (B, R), see update_policy
        if keep_params_gathered is None and lora is not None:
            keep_params_gathered = False  # a frozen bf16 base: gathering again is a copy, not a second base
        self._accumulation = {
            "defer_grad_sync": defer_grad_sync,
            "keep_params_gathered": keep_params_gathered,
        }
        self.fused_head = fused_head
        self.remove_padding = use_remove_padding or (dims is not None and dims.pp > 1)  # stages run packed
        if trainable:  # before the masters' dtype is chosen: a frozen tower keeps the compute dtype
            set_vision_trainable(lm, not freeze_vision_tower)
        parallel = parallelize(
            lm,
            dims,
            fsdp or actor.fsdp,
            trainable=trainable,
            root=lambda m: PolicyScorer(m, fused_head=fused_head),
            packed=self.remove_padding,
            checkpointing=gradient_checkpointing,
            compile=actor.use_torch_compile,
            device=device,
            lora=lora,
        )
        self.lora = lora
        optim: OptimConfig | None = actor.optim if trainable else None
        self.engine = TrainEngine(parallel, fsdp or actor.fsdp, optim, actor.grad_clip, total_steps)
        width = text_config(lm.config).hidden_size
        self.pipeline = pipeline_runner(self.engine, parallel.stage, width)
        self.runner = make_runner(self.engine, self.pipeline, self.remove_padding, **self._accumulation)
        self.router = self._router_terms(lm, dims)

    def _router_terms(self, lm: nn.Module, dims: ParallelDims | None) -> RouterTerms | None:
        """A MoE policy's auxiliary loss and router metrics (None: dense, or stages that cannot sum them)."""
        if not moe_blocks(lm):
            return None
        coef = aux_loss_coef(self.actor.router_aux_loss_coef, lm.config)
        if dims is not None and dims.pp > 1:  # the records sit on the stages: no per-micro-batch sum yet
            if self.actor.router_aux_loss_coef:
                raise UserError(
                    f"actor.router_aux_loss_coef={self.actor.router_aux_loss_coef} with pipeline stages "
                    "(pp > 1) is not implemented; set actor.router_aux_loss_coef=0 or pp=1"
                )
            logger.info("MoE load-balancing loss and router metrics are off with pipeline stages")
            return None
        return RouterTerms.attach(lm, coef)

    @property
    def dims(self) -> ParallelDims:
        """The training view, with its process groups."""
        return self.engine.dims

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self.engine.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the module computes in (FSDP2's ``param_dtype``)."""
        return self.engine.compute_dtype

    @property
    def module(self) -> nn.Module:
        """The FSDP2-wrapped ``PolicyScorer`` (its ``.lm`` is the Hugging Face model)."""
        return self.engine.module

    def dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (each model replica once, whatever its tp x pp ranks)."""
        return all_reduce_sum(x, self.engine.dp_group)

    def _device_fields(self, mb: Batch, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The named fields of a host micro-batch on the device (asynchronous copies)."""
        return {k: to_device(mb[k], self.engine.device) for k in keys if k in mb}

    @torch.no_grad()
    def compute_log_prob(
        self,
        batch: Batch,
        temperature: float = 1.0,
        micro_batch_size: int = 16,
        use_dynamic_bsz: bool = False,
        max_token_len: int = 16384,
        with_entropy: bool = False,
        with_routing: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Log-probs (B, R) of ``responses`` under the current weights, and entropy when asked (CPU tensors);
        ``with_routing``: also each token's experts, ``routed_experts`` (B, T, L, k) (router replay R2)."""
        check_batch(batch, SCORING_KEYS)
        self.engine.onload()
        self.module.eval()
        parts = micro_batch_indices(batch, micro_batch_size, use_dynamic_bsz, max_token_len)
        outputs = LogProbs(temperature, with_entropy, entropy_grad=False, fused=self.fused_head)
        out: dict[str, torch.Tensor] = {}
        if with_routing:
            results, out["routed_experts"] = self.runner.forward_routed(batch, parts, outputs)
        else:
            results = self.runner.forward(batch, parts, outputs)  # (B, R) each, on the device
        out["log_probs"] = results[0].cpu()  # one copy to the host per result, not one per micro-batch
        if with_entropy:
            out["entropys"] = results[1].cpu()
        self.engine.offload()
        return out

    def _epoch_order(self, rows: int, epoch: int) -> torch.Tensor:
        """``actor.shuffle``: a permutation of the rows for this epoch's mini-batches.

        Seeded by the updates done so far (the LR schedule's step count, which checkpoints restore) and the
        epoch, so a resumed run shuffles as the uninterrupted one did.
        """
        done = self.engine.scheduler.last_epoch if self.engine.scheduler is not None else 0
        generator = torch.Generator().manual_seed(1_000_003 * done + epoch)
        return torch.randperm(rows, generator=generator)

    def _mini_batches(self, batch: Batch) -> list[Batch]:
        dp = self.engine.dp_size
        size = self.actor.ppo_mini_batch_size * self.rollout_n // dp
        if size < 1:
            raise UserError(
                f"actor.ppo_mini_batch_size={self.actor.ppo_mini_batch_size} x rollout.n={self.rollout_n} "
                f"is smaller than the {dp} data-parallel ranks; raise ppo_mini_batch_size"
            )
        return batch.split(size)

    def update_policy(self, batch: Batch, temperature: float = 1.0) -> dict[str, float]:
        """Run ``ppo_epochs`` passes over the mini-batches of ``batch``; returns verl-named actor metrics.

        On-policy (one epoch, one mini-batch) the ratio's denominator is the update's own detached
        log-probs, so ``old_log_probs`` may be left out of ``batch``; the update then keeps those log-probs,
        taken before its optimizer step, in ``last_log_probs`` (B, R) on the host, in the batch's order.
        """
        keys = (*SCORING_KEYS, "response_mask", "advantages")
        check_batch(batch, keys + (("ref_log_prob",) if self.actor.use_kl_loss else ()))
        self.engine.onload()
        self.module.train()
        minis = self._mini_batches(batch)
        # On-policy (one epoch, one mini-batch): the ratio is exactly 1, so ppo_kl is exactly 0 on step 1.
        on_policy = self.actor.ppo_epochs == 1 and len(minis) == 1
        keep = "old_log_probs" not in batch
        if keep and not on_policy:
            raise UserError(
                f"the batch has no old_log_probs, which an update of {len(minis)} mini-batches x "
                f"{self.actor.ppo_epochs} epochs needs; compute them first (only one epoch over one "
                "mini-batch can do without)"
            )
        self.last_log_probs = None
        history: dict[str, list[float]] = defaultdict(list)
        for epoch in range(self.actor.ppo_epochs):
            if self.actor.shuffle and not on_policy:
                minis = self._mini_batches(batch[self._epoch_order(len(batch), epoch).numpy()])
            for mini in minis:
                for key, value in self._update_mini_batch(mini, temperature, on_policy, keep).items():
                    history[key].append(value)
        self.engine.lr_step()
        self.engine.offload()
        metrics = {key: sum(v) / len(v) for key, v in history.items()}
        metrics["actor/lr"] = self.engine.lr
        metrics["actor/skipped_steps"] = self.engine.skipped_steps  # non-finite grad norms so far
        if self.actor.use_kl_loss:
            metrics["actor/kl_coef"] = self.actor.kl_loss_coef
        return metrics

    def backward_micro_batches(
        self, batch: Batch, parts: list[list[int]], loss: MicroLoss, keys: tuple[str, ...] = ()
    ) -> dict[str, float]:
        """Backward of ``loss(micro_batch, [log_probs (b, R)])`` (temperature 1, no entropy) over each
        micro-batch of ``batch``, gradients accumulating for one optimizer step; returns the metric
        contributions the loss hands back, summed over the micro-batches and the data-parallel ranks, on
        every pipeline stage (``keys``: names reduced even where this rank has none)."""
        collected = self.runner.backward(batch, parts, LogProbs(fused=self.fused_head), loss)
        return self.runner.reduce_sums(collected.sums, keys)

    def update_sft(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of negative log-likelihood on the response tokens of ``batch`` (SFT)."""
        check_batch(batch, (*SCORING_KEYS, "response_mask"))
        self.engine.onload()
        self.module.train()
        a = self.actor
        dp = self.engine.dp_size
        counts = {k: int(self.dp_sum(v)) for k, v in local_batch_info(batch["response_mask"]).items()}
        parts = micro_batch_indices(
            batch, a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu
        )

        def nll(mb: Batch, outs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            mask = to_device(mb["response_mask"], self.engine.device)
            loss = -agg_loss(outs[0], mask, "token-mean", dp_size=dp, **counts)  # outs[0]: log-probs (b, R)
            return loss, {"sft/loss": loss.detach().double() / dp}

        loss_sum = self.backward_micro_batches(batch, parts, nll, keys=("sft/loss",))["sft/loss"]
        metrics = {"sft/loss": loss_sum, "sft/grad_norm": self.engine.optimizer_step()}
        self.engine.lr_step()
        self.engine.offload()
        metrics["sft/lr"] = self.engine.lr
        return metrics

    def _loss_config(self, mini: Batch) -> PolicyLossConfig:
        a = self.actor
        counts = {k: int(self.dp_sum(v)) for k, v in local_batch_info(mini["response_mask"]).items()}
        return PolicyLossConfig(
            loss_mode=a.policy_loss.loss_mode,
            clip_ratio=a.clip_ratio,
            clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c,
            loss_agg_mode=a.loss_agg_mode,
            clip_cov_ratio=a.policy_loss.clip_cov_ratio,
            clip_cov_lb=a.policy_loss.clip_cov_lb,
            clip_cov_ub=a.policy_loss.clip_cov_ub,
            kl_cov_ratio=a.policy_loss.kl_cov_ratio,
            ppo_kl_coef=a.policy_loss.ppo_kl_coef,
            dro_beta=a.policy_loss.dro_beta,
            tau_pos=a.policy_loss.tau_pos,
            tau_neg=a.policy_loss.tau_neg,
            rollout_correction=a.policy_loss.rollout_correction,
            dp_size=self.engine.dp_size,
            loss_scale_factor=a.loss_scale_factor,
            **counts,
        )

    def _micro_loss(
        self,
        mb: Batch,
        logp: torch.Tensor,  # (b, R)
        ent: torch.Tensor,  # (b, R)
        on_policy: bool,
        cfg: PolicyLossConfig,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's loss and its metric contributions (weighted to sum globally)."""
        a = self.actor
        agg = dict(
            dp_size=cfg.dp_size,
            batch_num_tokens=cfg.batch_num_tokens,
            global_batch_size=cfg.global_batch_size,
            loss_scale_factor=cfg.loss_scale_factor,
        )
        dev = self._device_fields(mb, LOSS_KEYS)
        mask = dev["response_mask"]  # (b, R)
        old = logp.detach() if on_policy else dev["old_log_probs"]
        weights = dev.get("rollout_is_weights")
        loss_fn = get_policy_loss_fn(a.policy_loss.loss_mode)
        pg_loss, pg_metrics = loss_fn(old, logp, dev["advantages"], mask, a.loss_agg_mode, cfg, weights)
        entropy = agg_loss(ent, mask, a.loss_agg_mode, **agg)
        loss = pg_loss - a.entropy_coeff * entropy if a.entropy_coeff else pg_loss
        share = mask.sum() / max(cfg.batch_num_tokens, 1)  # this micro-batch's share of the tokens
        metrics = {
            "actor/pg_loss": pg_loss.detach() / cfg.dp_size,
            "actor/entropy": entropy.detach() / cfg.dp_size,
        }
        metrics.update({k: v * share for k, v in pg_metrics.items()})
        if a.use_kl_loss:
            kl = agg_loss(kl_penalty(logp, dev["ref_log_prob"], a.kl_loss_type), mask, a.loss_agg_mode, **agg)
            loss = loss + a.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach() / cfg.dp_size
        if self.router is not None:
            # The micro-batch's share of the tokens weighs its auxiliary loss as agg_loss weighs the rest
            # (x dp_size: the gradients are averaged over the data-parallel ranks).
            tokens = None if self.remove_padding else mb["attention_mask"].reshape(-1)  # (b * T,)
            aux, moe_metrics = self.router.of(self.engine.module.lm, tokens)
            if aux is not None:
                loss = loss + self.router.coef * aux * share * cfg.dp_size
            metrics.update({k: v * share for k, v in moe_metrics.items()})
        return loss, metrics

    def _update_mini_batch(
        self, mini: Batch, temperature: float, on_policy: bool, keep_log_probs: bool = False
    ) -> dict[str, float]:
        a = self.actor
        cfg = self._loss_config(mini)
        parts = micro_batch_indices(
            mini, a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu
        )
        # the entropy is always reported; its gradient only flows with a coefficient
        outputs = LogProbs(temperature, True, a.entropy_coeff != 0, self.fused_head)

        def loss(mb: Batch, outs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return self._micro_loss(mb, outs[0], outs[1], on_policy, cfg)  # log-probs, entropy (b, R)

        collected = self.runner.backward(mini, parts, outputs, loss, keep=keep_log_probs)
        out = self.runner.reduce_sums(collected.sums)
        if keep_log_probs:  # taken before the optimizer step: the weights that generated the batch
            self.last_log_probs = collected.kept
        out["actor/grad_norm"] = self.engine.optimizer_step()
        return out
