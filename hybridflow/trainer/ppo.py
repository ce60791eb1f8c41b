"""The single controller of PPO-family training: one step is a dataflow of stages over one batch."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.algos import (
    compute_kl_in_reward,
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    get_adv_estimator_fn,
    get_kl_controller,
    group_zero_std_fraction,
)
from hybridflow.config.off_policy import default_correction, old_log_prob_source
from hybridflow.config.schema import Config
from hybridflow.data import PromptSampler, collate_prompts
from hybridflow.engine import layout_padding
from hybridflow.protocol import Batch
from hybridflow.rewards import place_on_last_token
from hybridflow.trainer.balance import balance_order, balance_parts
from hybridflow.trainer.dataflow import Dataflow, Stage
from hybridflow.trainer.dumps import rollout_records, write_jsonl
from hybridflow.trainer.loop import TrainingLoop
from hybridflow.trainer.metrics import (
    ZERO_STD_KEY,
    ClipWatch,
    SignalWatch,
    add_reshard_stats,
    add_rollout_stats,
    compute_data_metrics,
    step_peak_memory,
    throughput_metrics,
)
from hybridflow.trainer.tracking import Tracker
from hybridflow.utils.errors import UserError
from hybridflow.utils.progress import Progress
from hybridflow.workers.group import prompt_fields

logger = logging.getLogger(__name__)

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
SEQ_KEYS = (*PROMPT_KEYS, "responses")  # what every pass over (prompt + response) reads


def routing_writers(replay: str, old_source: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Who writes ``routed_experts`` for MoE router replay: (the rollout's keys, the old-log-prob pass's).

    r3: the rollout records its experts; r2: the old-log-prob pass does (without that pass the update's own
    forward is the old policy's and there is nothing to replay)."""
    key = ("routed_experts",)
    return (key if replay == "r3" else ()), (key if replay == "r2" and old_source == "recompute" else ())


def score_batch(scorer: Any, batch: Batch, metrics: dict[str, float]) -> Batch:
    """The reward stage's output: each sample's score on its last response token, ``acc``, and the reward
    function's extras as ``reward_extra/{key}/mean`` metrics."""
    scores, extra = scorer.score(batch)  # (B,), per-sample extras
    out = Batch({"token_level_scores": place_on_last_token(scores, batch["response_mask"])})
    out["acc"] = np.asarray(extra.get("acc", (scores > 0).float().tolist()), dtype=object)
    for key, values in extra.items():
        if key != "acc":
            metrics[f"reward_extra/{key}/mean"] = float(np.mean(values)) if len(values) else 0.0
    return out


class PPOTrainer(TrainingLoop):
    """Drives the workers: rollout, reward, log-probs, values, advantages, critic and actor updates."""

    def __init__(self, cfg: Config, components: Any, tracker: Tracker | None = None) -> None:
        default_correction(cfg)
        super().__init__(cfg, components, tracker)
        self.kl_ctrl = get_kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
        # With dynamic sampling a round draws data.gen_batch_size prompts (verl's oversampling), else one batch.
        per_round = cfg.data.gen_batch_size if cfg.algorithm.filter_groups.enable else None
        # No training set: the step-wise API, whose caller brings the prompts of every step.
        self.sampler = (
            PromptSampler(
                len(components.train),
                per_round or cfg.data.train_batch_size,
                cfg.trainer.seed,
                shuffle=cfg.data.shuffle,
            )
            if components.train is not None
            else None
        )
        self.old_source = old_log_prob_source(cfg)
        self.dataflow = self._dataflow(self.old_source)
        self._dataflows = {self.old_source: self.dataflow}
        self.clip_watch = ClipWatch(cfg.data.max_response_length)
        self.signal_watch = SignalWatch(cfg, self.total_steps)  # a run whose first steps teach nothing

    def dataflow_for(self, prompts: int) -> Dataflow:
        """The step's dataflow for a batch of ``prompts`` prompts: whether the update needs a separate
        old-log-prob pass depends on how many mini-batches the batch makes."""
        source = old_log_prob_source(self.cfg, prompts)
        if source not in self._dataflows:
            self._dataflows[source] = self._dataflow(source)
        return self._dataflows[source]

    def _dataflow(self, old_source: str) -> Dataflow:
        return Dataflow(
            self._stages(old_source),
            inputs=(*PROMPT_KEYS, "data_source", "ground_truth", "extra_info"),
            keep=(
                "token_level_scores",
                "token_level_rewards",
                "response_mask",
                "attention_mask",
                "advantages",
                "returns",
                "values",
                "acc",
            ),
        )

    # ----- the recipe -------------------------------------------------------------------------------------
    def _stages(self, old_source: str) -> list[Stage]:
        cfg = self.cfg
        scores = ("token_level_scores", "acc")
        by_rollout, by_old_pass = routing_writers(cfg.actor.router_replay, old_source)
        routed = by_rollout or by_old_pass
        stages = [
            Stage(
                "gen",
                PROMPT_KEYS,
                ("responses", "response_mask", "rollout_log_probs", "uid", *by_rollout)
                + (("harness_reward",) if cfg.rollout.harness.enabled else ()),
                self._rollout,
                replaces_batch=True,
            ),
            Stage(
                "reward",
                ("responses", "response_mask", "data_source", "ground_truth")
                + (("harness_reward",) if cfg.rollout.harness.enabled else ()),
                scores,
                self._reward,
                # beside the log-prob passes, joined before "adv"; ReMax's baseline scores in between
                background=cfg.reward.launch_async and cfg.algorithm.adv_estimator != "remax",
            ),
        ]
        if old_source == "recompute":
            reads = ("input_ids", "responses", *by_rollout)
            writes = ("old_log_probs", "entropys", *by_old_pass)
            stages.append(Stage("old_log_prob", reads, writes, self._old_log_prob))
        elif old_source == "rollout":
            stages.append(Stage("old_log_prob", ("rollout_log_probs",), ("old_log_probs",), self._bypass))
        if cfg.trainer.rollout_data_dir:
            reads = (*SEQ_KEYS, "response_mask", "token_level_scores", "uid", "data_source", "ground_truth")
            stages.append(Stage("dump_rollout", reads, (), self._dump_rollout))
        if cfg.algorithm.adv_estimator == "remax":
            reads = (*SEQ_KEYS, "data_source", "ground_truth", "extra_info")
            stages.append(Stage("gen_max", reads, ("reward_baselines",), self._greedy_baseline))
        if self.c.ref is not None:
            stages.append(Stage("ref", (*SEQ_KEYS, *routed), ("ref_log_prob",), self._ref_log_prob))
        if self.c.critic is not None:
            stages.append(Stage("values", SEQ_KEYS, ("values",), self._values))
        adv_reads = ["token_level_scores", "response_mask", "uid", "rollout_log_probs"]
        adv_reads += ["old_log_probs"] if old_source != "update" else []
        adv_reads += ["ref_log_prob"] if cfg.algorithm.use_kl_in_reward else []
        adv_reads += ["values"] if self.c.critic is not None else []
        adv_reads += ["reward_baselines"] if cfg.algorithm.adv_estimator == "remax" else []
        stages.append(
            Stage("adv", tuple(adv_reads), ("advantages", "returns", "token_level_rewards"), self._advantages)
        )
        if self.c.critic is not None:
            stages.append(
                Stage(
                    "update_critic",
                    (*SEQ_KEYS, "values", "returns", "response_mask"),
                    (),
                    self._update_critic,
                )
            )
        actor_reads = [*SEQ_KEYS, "advantages", "response_mask", *routed]
        actor_reads += ["old_log_probs"] if old_source != "update" else ["rollout_log_probs"]
        actor_reads += ["ref_log_prob"] if cfg.actor.use_kl_loss else []
        stages.append(Stage("update_actor", tuple(actor_reads), (), self._update_actor))
        return stages

    def step(self) -> dict[str, float]:
        """One training step: the dataflow over a fresh batch of prompts, then the step's metrics."""
        start = time.perf_counter()
        metrics: dict[str, float] = {"training/global_step": float(self.global_step)}
        batch = self.dataflow.run(self._next_prompts(), metrics)
        elapsed = time.perf_counter() - start
        memory = self.c.actor.memory()
        metrics.update(memory)
        metrics.update(compute_data_metrics(batch, self.cfg.data.max_response_length))
        metrics.update(throughput_metrics(batch, elapsed, self.cfg.trainer.world_size))
        metrics.update(step_peak_memory(memory))
        self.clip_watch.update(metrics)
        self.signal_watch.update(metrics, self.c.scorer.describe)
        return metrics

    def _next_prompts(self) -> Batch:
        """The step's prompts: the sampler's next batch, collated (left-padded)."""
        indices = self.sampler.next_batch()
        return collate_prompts([self.c.train[i] for i in indices], self.c.pad_token_id)

    def _sampling_params(self) -> Any:
        """The rollout's sampling settings of this step (its seed moves with the step)."""
        r = self.cfg.rollout
        return self.c.actor.sampling_params(
            r.n,
            r.temperature,
            r.top_p,
            r.top_k,
            r.do_sample,
            self.c.eos_token_ids,
            seed=self.cfg.trainer.seed + self.global_step,
        )

    # ----- stages -----------------------------------------------------------------------------------------
    def _generate(self, prompts: Batch, metrics: dict[str, float]) -> Batch:
        """Sample rollout.n responses per prompt; the prompts' non-tensor fields repeat alongside."""
        r = self.cfg.rollout
        params = self._sampling_params()
        out = self.c.actor.generate(prompt_fields(prompts, rows=r.harness.enabled), params)
        add_rollout_stats(metrics, out.meta.pop("rollout_stats", None))
        metrics.update({k: float(v) for k, v in out.meta.pop("multi_turn", {}).items()})  # rollout.multi_turn
        add_reshard_stats(metrics, out.meta.pop("reshard", None))
        rows = out.meta.pop("rows_per_prompt", r.n)  # a harness's episodes may leave several rows, or none
        for key, values in prompts.non_tensors.items():
            out[key] = np.repeat(values, rows)
        return out

    def _rollout(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        # From here on the batch holds one row per sample: prompts' fields repeat n times, interleaved.
        if not self.cfg.algorithm.filter_groups.enable:
            out = self._generate(batch, metrics)
        else:
            out = self._dynamic_sampling(batch, metrics)
        if not self.cfg.trainer.balance_batch:
            return out
        parts = balance_parts(h.dp_size for h in (self.c.actor, self.c.ref, self.c.critic) if h is not None)
        if parts == 1:
            return out
        order, balance = balance_order(out["attention_mask"].sum(-1).tolist(), parts)
        metrics.update(balance)
        return out[order]  # part r is now the r-th balanced group; a role's share is a run of parts

    def _dynamic_sampling(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        """DAPO: keep only groups whose scores vary, generating more rounds until the batch is full."""
        fg, n, want = self.cfg.algorithm.filter_groups, self.cfg.rollout.n, self.cfg.data.train_batch_size
        kept: list[Batch] = []
        rounds = total = 0
        while sum(len(k) for k in kept) < want * n:
            rounds += 1
            if fg.max_num_gen_batches > 0 and rounds > fg.max_num_gen_batches:
                raise UserError(
                    f"dynamic sampling found {sum(len(k) for k in kept) // n} of {want} groups with varying "
                    f"{fg.metric} in {fg.max_num_gen_batches} rounds; raise algorithm.filter_groups."
                    "max_num_gen_batches or disable algorithm.filter_groups"
                )
            if rounds > 1:  # a fresh batch of prompts for every further round
                batch = collate_prompts(
                    [self.c.train[i] for i in self.sampler.next_batch()], self.c.pad_token_id
                )
            out = self._generate(batch, metrics)
            scored = self._reward(out, metrics)
            for key in scored.keys():  # noqa: SIM118 (a Batch is not iterable)
                out[key] = scored[key]
            values = (
                out["token_level_scores"].sum(-1)
                if fg.metric == "seq_reward"
                else torch.tensor([float(a) for a in out["acc"]])
            )
            varied = values.view(-1, n).std(dim=1) > 0  # (groups,)
            total += len(varied)
            keep = torch.repeat_interleave(varied, n).nonzero().flatten()
            kept.append(out[keep.numpy()])
        metrics["train/num_gen_batches"] = float(rounds)
        metrics["train/kept_group_ratio"] = sum(len(k) for k in kept) / n / max(total, 1)
        # Each round's prompts were padded to that round's longest: widen them to one layout.
        return Batch.concat(kept, pad=layout_padding(self.c.pad_token_id))[: want * n]

    def _reward(self, batch: Batch, metrics: dict[str, float]) -> Batch | None:
        if "token_level_scores" in batch:
            return None  # dynamic sampling scored the samples already
        return score_batch(self.c.scorer, batch, metrics)

    def _dump_rollout(self, batch: Batch, metrics: dict[str, float]) -> None:
        if self.rank == 0:
            records = rollout_records(self.c.tokenizer, batch, self.global_step)
            write_jsonl(records, Path(self.cfg.trainer.rollout_data_dir) / f"{self.global_step}.jsonl")

    def _old_log_prob(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        out = self.c.actor.compute_log_prob(batch)
        mask = batch["response_mask"]
        metrics["actor/entropy"] = float((out["entropys"] * mask).sum() / mask.sum().clamp(min=1))
        return out

    def _bypass(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        return Batch({"old_log_probs": batch["rollout_log_probs"]})

    def _greedy_baseline(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        params = self.c.actor.sampling_params(1, 0.0, 1.0, -1, False, self.c.eos_token_ids, seed=None)
        n, R = self.cfg.rollout.n, batch["responses"].shape[1]
        prompts = Batch(
            {k: batch[k][::n, :-R] for k in PROMPT_KEYS}
        )  # one prompt per group, response cut off
        greedy = self.c.actor.generate(prompts, params, desc="greedy baseline")
        for key in ("data_source", "ground_truth", "extra_info"):
            greedy[key] = batch[key][::n]
        base, _ = self.c.scorer.score(greedy)
        return Batch({"reward_baselines": base.repeat_interleave(n)})

    def _ref_log_prob(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        return self.c.ref.compute_ref_log_prob(batch)

    def _values(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        return self.c.critic.compute_values(batch)

    def _advantages(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        a = self.cfg.algorithm
        mask = batch["response_mask"]
        rewards = batch["token_level_scores"]
        if a.use_kl_in_reward:
            rewards, kl = compute_kl_in_reward(
                rewards, batch["old_log_probs"], batch["ref_log_prob"], mask, self.kl_ctrl.value, a.kl_penalty
            )
            metrics["actor/reward_kl_penalty"] = kl
            metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctrl.value
            self.kl_ctrl.update(kl, n_steps=len(batch))
        kwargs: dict[str, Any] = dict(token_level_rewards=rewards, response_mask=mask, config=a)
        est = a.adv_estimator
        if est == "gae":
            kwargs.update(values=batch["values"], gamma=a.gamma, lam=a.lam)
        elif est == "remax":
            kwargs.update(reward_baselines=batch["reward_baselines"])
        elif est != "reinforce_plus_plus":
            kwargs.update(index=np.asarray(batch["uid"]), norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo)
            # groups whose samples all scored alike: a group-relative estimator learns nothing from them
            tied = group_zero_std_fraction(batch["token_level_scores"].sum(-1), kwargs["index"])
            if tied is not None:
                metrics[ZERO_STD_KEY] = tied
        advantages, returns = get_adv_estimator_fn(est)(**kwargs)
        out = Batch({"advantages": advantages, "returns": returns, "token_level_rewards": rewards})
        if "old_log_probs" not in batch:  # on-policy: the update reports the mismatch metrics
            return out
        # Rollout-vs-trainer mismatch metrics every step; IS weights / rejection only when configured.
        rc = a.rollout_correction
        weights, new_mask, rc_metrics = compute_rollout_correction_and_rejection_mask(
            batch["old_log_probs"],
            batch["rollout_log_probs"],
            mask,
            rollout_is=rc.rollout_is,
            rollout_is_threshold=rc.rollout_is_threshold,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
            rollout_rs=rc.rollout_rs,
            rollout_rs_threshold=rc.rollout_rs_threshold,
        )
        metrics.update({k: float(v) for k, v in rc_metrics.items()})
        if weights is not None:
            out["rollout_is_weights"] = weights
        if rc.rollout_rs:
            out["response_mask"] = new_mask.to(mask.dtype)
        return out

    def _update_critic(self, batch: Batch, metrics: dict[str, float]) -> None:
        with Progress("update critic", unit="step") as bar:
            metrics.update(self.c.critic.update_critic(batch))
            bar.update()

    def _update_actor(self, batch: Batch, metrics: dict[str, float]) -> None:
        if self.global_step <= self.cfg.trainer.critic_warmup:
            return
        with Progress("update actor", unit="step") as bar:
            update_metrics, own = self.c.actor.update_actor(batch)
            metrics.update(update_metrics)
            bar.update()
        if own is not None and "rollout_log_probs" in batch:  # on-policy: no separate old-log-prob pass
            mismatch = compute_offpolicy_metrics(
                own["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
            )
            metrics.update({f"rollout_corr/{k}": float(v) for k, v in mismatch.items()})
