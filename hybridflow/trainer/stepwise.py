"""The step-wise API of the HybridFlow write-ups, for users who write their own loop::

    trainer = Trainer(actor_model="/models/my-model", critic_model="/models/my-model", reward_fn=fn)
    for step in range(100):
        responses = trainer.generate(prompts)            # the rollout stage
        rewards = trainer.critic_score(responses)        # the reward stage (+ the critic's values)
        metrics = trainer.update_actor(responses, rewards)  # log-probs, advantages, critic and actor updates
    trainer.save()

Each call runs the ``PPOTrainer``'s own stages (``trainer.ppo``) in the dataflow's order on the same workers
(``trainer.builder``): the same seed and prompts give the same metrics as ``RLTrainer`` / ``hybridflow train``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.data import RLDataset, collate_prompts
from hybridflow.protocol import Batch
from hybridflow.rewards import place_on_last_token
from hybridflow.rewards.shapes import recognise_reward
from hybridflow.trainer.api import build_config, build_dataset
from hybridflow.trainer.builder import build_components, load_policy
from hybridflow.trainer.checkpointing import save_checkpoint
from hybridflow.trainer.jobs import run_names, start_job
from hybridflow.trainer.metrics import compute_data_metrics, step_peak_memory, throughput_metrics
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.scoring import known_sources
from hybridflow.trainer.tracking import Tracker
from hybridflow.utils.errors import UserError
from hybridflow.utils.logging import setup_console_logging
from hybridflow.utils.text import batch_decode

logger = logging.getLogger(__name__)

SCORE_STAGES = ("reward", "values")  # critic_score; generate runs "gen", update_actor the rest


@dataclass
class Responses:
    """The samples of one ``generate`` call: the batch the stages share, and the response texts."""

    batch: Batch
    texts: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    done: set[str] = field(default_factory=set)  # the stages run on it so far

    def __len__(self) -> int:
        return len(self.texts)


@dataclass
class Rewards:
    """Per-sample scores (and the critic's values, when there is a critic) of one ``Responses``."""

    scores: list[float]
    values: torch.Tensor | None = None


class Trainer:
    """Step-wise PPO-family training: ``generate``, ``critic_score``, ``update_actor`` and ``save``.

    ``actor_model`` is a local model directory; ``critic_model`` (a directory, or True for the actor's) adds a
    critic (GAE by default then); ``ref_model`` (True, or the actor's directory: the reference is the initial
    policy) keeps a reference for KL terms. ``reward_fn`` takes any shape ``RLTrainer`` accepts; without one,
    ``update_actor`` takes the scores as a list. The other keywords are ``RLTrainer``'s.
    """

    def __init__(
        self,
        actor_model: str,
        critic_model: str | bool | None = None,
        ref_model: str | bool | None = None,
        reward_fn: Any = None,
        algorithm: str | None = None,
        *,
        config: str | None = None,
        overrides: list[str] | None = None,
        **keywords: Any,
    ) -> None:
        setup_console_logging()
        self.reward = recognise_reward(reward_fn) if reward_fn is not None else None
        roles = _role_overrides(actor_model, critic_model, ref_model)
        algorithm = algorithm or ("gae" if critic_model else "grpo")
        keywords = dict(keywords, model_name=actor_model, algorithm=algorithm)
        self.cfg, self.layout = build_config(keywords, config, roles + list(overrides or []))
        if self.cfg.trainer.total_training_steps is None:
            self.cfg.trainer.total_training_steps = 10**6  # the loop is the caller's: no end to plan for
        start_job(self.cfg)
        model, self.tokenizer = load_policy(self.cfg)
        placeholder = RLDataset(
            [{"prompt": "-", "data_source": known_sources()[0]}], self.tokenizer, require_ground_truth=False
        )
        self.components = build_components(self.cfg, model, self.tokenizer, self.reward, train=placeholder)
        self.loop = PPOTrainer(self.cfg, self.components)  # its stages; its sampler is never drawn from
        run_dir = self.cfg.trainer.run_dir()
        self.tracker = Tracker(
            run_dir, self.loop.total_steps, loggers=self.cfg.trainer.logger, **run_names(self.cfg)
        )
        self.last_metrics: dict[str, float] = {}

    @property
    def global_step(self) -> int:
        """Steps taken so far (``generate`` starts the next one)."""
        return self.loop.global_step

    def _run(self, names: Sequence[str], batch: Batch, metrics: dict[str, float], done: set[str]) -> Batch:
        """The dataflow's stages of ``names`` not run yet, in its order, timed as the dataflow times them."""
        for stage in self.loop.dataflow.stages:
            if stage.name not in names or stage.name in done:
                continue
            start = time.perf_counter()
            out = stage.run(batch, metrics)
            metrics[f"timing_s/{stage.name}"] = time.perf_counter() - start
            done.add(stage.name)
            if stage.replaces_batch:
                batch = out
            elif out is not None:
                for key in out.keys():  # noqa: SIM118 (a Batch is not iterable)
                    batch[key] = out[key]
        return batch

    def generate(self, prompts: Any) -> Responses:
        """``rollout.n`` responses per prompt (prompt strings, chat messages or rows), interleaved."""
        data = build_dataset(self.cfg, prompts, self.tokenizer, self.reward)
        batch = collate_prompts([data[i] for i in range(len(data))], self.components.pad_token_id)
        self.loop.global_step += 1
        metrics: dict[str, float] = {"training/global_step": float(self.loop.global_step)}
        responses = Responses(Batch({}), [], metrics)
        responses.batch = self._run(("gen",), batch, metrics, responses.done)
        mask = responses.batch["response_mask"].bool()
        ids = [row[m].tolist() for row, m in zip(responses.batch["responses"], mask)]
        responses.texts = batch_decode(self.tokenizer, ids, skip_special_tokens=True)
        return responses

    def critic_score(self, responses: Responses) -> Rewards:
        """The reward function's (or reward model's) score of each response, and the critic's values."""
        if self.reward is None and not self.cfg.reward.model.enable:
            raise UserError(
                "critic_score needs a reward: pass reward_fn= to Trainer (or reward.model.enable=true), or "
                "give update_actor the scores as a list"
            )
        responses.batch = self._run(SCORE_STAGES, responses.batch, responses.metrics, responses.done)
        return _rewards_of(responses.batch)

    def update_actor(
        self, responses: Responses, rewards: Rewards | Sequence[float] | torch.Tensor
    ) -> dict[str, float]:
        """Advantages with the configured estimator, then the critic's and the actor's updates; the metrics."""
        batch = responses.batch
        if not isinstance(rewards, Rewards):
            scores = torch.as_tensor(
                list(rewards) if not torch.is_tensor(rewards) else rewards, dtype=torch.float32
            )
            if scores.shape != (len(responses),):
                raise UserError(
                    f"rewards has {tuple(scores.shape)} entries for {len(responses)} responses; give one per response"
                )
            batch["token_level_scores"] = place_on_last_token(scores, batch["response_mask"])
            batch["acc"] = np.asarray((scores > 0).float().tolist(), dtype=object)
            responses.done.add("reward")
        elif "reward" not in responses.done:
            raise UserError(
                "these rewards belong to other responses: score them with critic_score(responses)"
            )
        names = [s.name for s in self.loop.dataflow.stages if s.name != "gen"]
        batch = self._run(names, batch, responses.metrics, responses.done)
        metrics = responses.metrics
        memory = self.components.actor.memory()
        metrics.update(memory)
        metrics.update(compute_data_metrics(batch, self.cfg.data.max_response_length))
        metrics.update(
            throughput_metrics(batch, time.perf_counter() - responses.started, self.cfg.trainer.world_size)
        )
        metrics.update(step_peak_memory(memory))
        self.tracker.log(self.loop.global_step, metrics)
        self.last_metrics = metrics
        return metrics

    def save(self, hf_dir: str | Path | None = None) -> Path:
        """A resumable checkpoint (``{run_dir}/global_step_N``); with ``hf_dir`` the policy as an HF model too."""
        path = save_checkpoint(self.loop, self.last_metrics or None)
        if hf_dir is not None:
            self.components.groups[0].run_all("save_hf_model", str(hf_dir))
        return path

    def close(self) -> None:
        """Close the metrics file and stop the workers."""
        self.tracker.close()
        self.components.close()


def _rewards_of(batch: Batch) -> Rewards:
    values = batch["values"] if "values" in batch else None  # noqa: SIM401 (Batch has no get)
    return Rewards(batch["token_level_scores"].sum(-1).tolist(), values)


def _role_overrides(actor: str, critic: str | bool | None, ref: str | bool | None) -> list[str]:
    """The overrides that give the critic and the reference."""
    out = []
    if critic:
        out.append("critic.enable=true")
        if isinstance(critic, str) and critic != actor:
            out.append(f"critic.model.path={critic}")
    if ref:
        if isinstance(ref, str) and Path(ref).resolve() != Path(actor).resolve():
            raise UserError(
                f"ref_model={ref!r}: the reference is the actor's initial policy ({actor}); pass ref_model=True "
                "or the actor's directory"
            )
        out.append("ref.enable=true")
    return out
