"""The step-wise API of the HybridFlow write-ups, for users who write their own loop::

    trainer = Trainer(actor_model="/models/my-model", critic_model="/models/my-model", reward_fn=fn)
    for step in range(100):
        responses = trainer.generate(prompts)            # the rollout stage
        rewards = trainer.critic_score(responses)        # the reward stage (+ the critic's values)
        metrics = trainer.update_actor(responses, rewards)  # log-probs, advantages, critic and actor updates
    trainer.save()

Each call runs the ``PPOTrainer``'s own stages (``trainer.ppo``) in the dataflow's order on the same workers
(``trainer.builder``): the same seed and prompts give the same metrics as ``RLTrainer`` / ``hybridflow train``.
``generate`` takes any number of prompts (strings, chat messages, rows, a ``datasets.Dataset``); the stages
are chosen for that batch (an update over several mini-batches gets its old-log-prob pass). Without
``reward_fn``, a function or the scores themselves go to ``critic_score`` or ``update_actor``. Each
``Responses`` trains once, and only the policy that sampled it unless ``allow_stale=True``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.api import lengths
from hybridflow.api.keywords import KEYWORDS, check_keywords
from hybridflow.api.notebook import ConfigSource, Setup, build_dataset, log_layout, plan
from hybridflow.api.run_dirs import Resume, run_dir_settings
from hybridflow.config import Config, save_config
from hybridflow.data import collate_prompts
from hybridflow.protocol import Batch
from hybridflow.rewards import place_on_last_token
from hybridflow.rewards.shapes import recognise_reward
from hybridflow.trainer.builder import build_components, load_policy
from hybridflow.trainer.checkpointing import save_checkpoint
from hybridflow.trainer.dataflow import Dataflow
from hybridflow.trainer.jobs import run_names, start_job
from hybridflow.trainer.metrics import compute_data_metrics, step_peak_memory, throughput_metrics
from hybridflow.trainer.ppo import PPOTrainer, score_batch
from hybridflow.trainer.scoring import Scorer, build_reward_manager, has_scorer, known_sources
from hybridflow.trainer.tracking import Tracker
from hybridflow.utils.dirlock import RunLock, lock_run_dir
from hybridflow.utils.errors import UserError
from hybridflow.utils.logging import setup_console_logging
from hybridflow.utils.storage import ensure_writable_dir
from hybridflow.utils.text import batch_decode
from hybridflow.workers.build import load_policy_tokenizer

logger = logging.getLogger(__name__)

SCORE_STAGES = ("reward", "values")  # critic_score; generate runs "gen", update_actor the rest
POSITION = "prompt_position"  # each sample's prompt: its position in the generate call's prompts
DATA_LOGGERS = ("user_rows", "rl_dataset")
GIVEN_SCORES = "the scores given to update_actor"  # the modules whose notices say how rows become prompts


@dataclass
class Rewards:
    """Per-sample scores (and the critic's values, when there is a critic) of one ``Responses``."""

    scores: list[float]
    values: torch.Tensor | None = None


@dataclass
class Responses:
    """The samples of one ``generate`` call: the batch the stages share, and the response texts.

    ``prompt_index[i]`` is the position, among the prompts given to ``generate``, of the prompt of
    ``texts[i]`` (prompts over the length limit are left out, see ``api.lengths``). ``sampled_at`` is the
    step the samples were drawn for: one more than the actor's updates at the time. ``busy_s`` is the time
    the trainer's calls on these samples took so far (generate, critic_score): the step's time
    (``perf/time_per_step``) is theirs plus the update's, and not the caller's own time between the calls.
    """

    batch: Batch
    texts: list[str]
    prompt_index: list[int]
    prompts: int
    sampled_at: int
    metrics: dict[str, float] = field(default_factory=dict)
    busy_s: float = 0.0
    done: set[str] = field(default_factory=set)  # the stages run on it so far
    rewards: Rewards | None = None  # critic_score's result
    scored_by: Callable[[], str] = field(default=lambda: GIVEN_SCORES)  # who scored (a warning names it)
    trained_at: int | None = None  # the step update_actor trained on it

    def __len__(self) -> int:
        return len(self.texts)


class Trainer:
    """Step-wise PPO-family training: ``generate``, ``critic_score``, ``update_actor`` and ``save``.

    ``actor_model`` is a local model directory; ``critic_model`` (a directory, or True for the actor's) adds a
    critic (GAE by default then); ``ref_model`` (True, or the actor's directory: the reference is the initial
    policy) keeps a reference for KL terms. ``reward_fn`` takes any shape ``RLTrainer`` accepts; without one,
    ``critic_score`` or ``update_actor`` take a function or the scores. The other keywords are
    ``RLTrainer``'s (``max_steps``: the run's length, shown in the step line and sizing the schedule); the run
    directory and ``resume_from_checkpoint`` follow ``api.run_dirs``.
    """

    def __init__(
        self,
        actor_model: str,
        critic_model: str | bool | None = None,
        ref_model: str | bool | None = None,
        reward_fn: Any = None,
        algorithm: str | None = None,
        *,
        config: ConfigSource = None,
        overrides: list[str] | None = None,
        resume_from_checkpoint: Resume = None,
        **keywords: Any,
    ) -> None:
        accepted = [k for k in KEYWORDS if k != "model_name"]
        check_keywords(keywords, (*accepted, "config", "overrides", "resume_from_checkpoint"), "Trainer")
        setup_console_logging()
        self.reward = recognise_reward(reward_fn) if reward_fn is not None else None
        roles = _role_overrides(actor_model, critic_model, ref_model)
        defaults = {"algorithm.adv_estimator": "gae" if critic_model else "grpo", "actor.hybrid_engine": True}
        keywords = dict(keywords, model_name=actor_model, algorithm=algorithm)
        setup = Setup.of(keywords, config, roles + list(overrides or []), defaults)
        self.cfg, self.layout, self.prompt_limit = _configure(setup, resume_from_checkpoint)
        log_layout(self.cfg, self.layout)
        _check_step_wise(self.cfg)
        start_job(self.cfg)
        if self.cfg.trainer.backend == "ray":
            model, self.tokenizer = None, load_policy_tokenizer(self.cfg)
        else:
            model, self.tokenizer = load_policy(self.cfg)
        self.components = build_components(self.cfg, model, self.tokenizer, self.reward, step_wise=True)
        self._lock: RunLock | None = None
        try:
            self._start()
        except BaseException:
            self.components.close()  # the workers (Ray actors too) do not outlive a failed construction
            if self._lock is not None:
                self._lock.release()
            raise
        self.last_metrics: dict[str, float] = {}
        self._scorers: dict[int, tuple[Callable, Scorer]] = {}

    def _start(self) -> None:
        """The loop's stages and state (resumed when the run directory holds a checkpoint), and the tracker."""
        if self.cfg.trainer.async_mode != "sync":
            raise UserError(
                f"trainer.async_mode={self.cfg.trainer.async_mode}: the step-wise API trains on the prompts "
                "each call brings, synchronously; use trainer.async_mode=sync (or hybridflow train)"
            )
        self.run_dir = ensure_writable_dir(self.cfg.trainer.run_dir(), "the run directory (output_dir=)")
        self._lock = lock_run_dir(self.run_dir, "output_dir=")  # one run per directory, until close()
        self.loop = PPOTrainer(self.cfg, self.components)  # no prompt sampler: the caller brings the prompts
        start = self.loop.resume()
        self._updates = self._rollouts = start
        self._notices = _SaidOnce()
        save_config(self.cfg, self.run_dir / "config.yaml")
        self.tracker = Tracker(
            self.run_dir,
            self.cfg.trainer.total_training_steps,
            loggers=self.cfg.trainer.logger,
            resume_step=start if start > 0 else None,
            saved_records=self.loop.saved_metrics,
            **run_names(self.cfg),
        )
        self.loop.tracker = self.tracker  # a checkpoint makes the metrics written so far durable first

    @property
    def global_step(self) -> int:
        """Steps taken so far: the actor's updates (``update_actor`` ends a step)."""
        return self._updates

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(
        self,
        flow: Dataflow,
        names: Sequence[str],
        batch: Batch,
        metrics: dict[str, float],
        done: set[str],
        scorer: Scorer | None = None,
    ) -> Batch:
        """The dataflow's stages of ``names`` not run yet, in its order, timed as the dataflow times them."""
        for stage in flow.stages:
            if stage.name not in names or stage.name in done:
                continue
            start = time.perf_counter()
            if stage.name == "reward":  # the scorer of this call's reward (the trainer's own by default)
                out = score_batch(scorer or self.components.scorer, batch, metrics)
            else:
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
        """``rollout.n`` responses per prompt (prompt strings, chat messages, rows or a dataset), interleaved."""
        started = time.perf_counter()
        needs_truth = self.reward is not None and self.reward.needs_ground_truth
        with self._notices.applied():  # how rows become prompts: said once per Trainer
            data = build_dataset(
                self.cfg, prompts, self.tokenizer, self.reward, self.prompt_limit, needs_truth
            )
        batch = collate_prompts([data[i] for i in range(len(data))], self.components.pad_token_id)
        batch[POSITION] = np.asarray([o.row for o in data.origins], dtype=object)
        flow = self.loop.dataflow_for(len(data))
        self._rollouts += 1
        metrics: dict[str, float] = {}
        done: set[str] = set()
        self.loop.global_step = self._rollouts  # seeds the sampling as the dataflow's step of that number
        try:
            batch = self._run(flow, ("gen",), batch, metrics, done)
        finally:
            self.loop.global_step = self._updates
        mask = batch["response_mask"].bool()
        ids = [row[m].tolist() for row, m in zip(batch["responses"], mask)]
        texts = batch_decode(self.tokenizer, ids, skip_special_tokens=True)
        positions = [int(p) for p in batch[POSITION]]
        busy = time.perf_counter() - started
        return Responses(batch, texts, positions, len(data), self._updates + 1, metrics, busy, done=done)

    def critic_score(self, responses: Responses, reward_fn: Callable | None = None) -> Rewards:
        """Each response's score, by ``reward_fn`` (any shape ``RLTrainer`` takes) or the trainer's reward
        (function, ``reward.custom_function``, reward model or built-in scorer), and the critic's values."""
        _check_responses(responses)
        started = time.perf_counter()
        scorer = self._scorer(reward_fn, responses.batch)
        flow = self.loop.dataflow_for(responses.prompts)
        responses.done.discard("reward")  # scoring again (another function) replaces the scores
        responses.batch = self._run(
            flow, SCORE_STAGES, responses.batch, responses.metrics, responses.done, scorer
        )
        responses.rewards = _rewards_of(responses.batch)
        responses.scored_by = scorer.describe
        responses.busy_s += time.perf_counter() - started
        return responses.rewards

    def update_actor(
        self,
        responses: Responses,
        rewards: Rewards | Sequence[float] | torch.Tensor | Callable | None = None,
        *,
        allow_stale: bool = False,
    ) -> dict[str, float]:
        """Advantages with the configured estimator, then the critic's and the actor's updates: one step;
        its metrics. ``rewards``: ``critic_score``'s result, one score per response (in ``responses.texts``'
        order), a reward function, or None (``critic_score``'s scores, else the trainer's reward).
        ``allow_stale=True`` trains on responses sampled before the actor's latest update (off-policy)."""
        _check_responses(responses)
        self._check_trainable(responses, allow_stale)
        started = time.perf_counter()
        flow = self.loop.dataflow_for(responses.prompts)
        if isinstance(rewards, Rewards):
            if rewards is not responses.rewards:
                raise UserError(
                    "these rewards belong to other responses: score these with critic_score(responses), or "
                    "pass their scores as a list"
                )
        elif callable(rewards) or (rewards is None and "reward" not in responses.done):
            self.critic_score(responses, rewards)
            started = time.perf_counter()  # critic_score counted its own time
        elif rewards is not None:
            scores = check_scores(rewards, len(responses))  # (B,)
            batch = responses.batch
            batch["token_level_scores"] = place_on_last_token(scores, batch["response_mask"])
            batch["acc"] = np.asarray((scores > 0).float().tolist(), dtype=object)
            responses.done.add("reward")
            responses.scored_by = lambda: GIVEN_SCORES
        step = self._updates + 1
        metrics = responses.metrics
        metrics["training/global_step"] = float(step)
        names = [s.name for s in flow.stages if s.name != "gen"]
        self.loop.global_step = step
        try:
            batch = self._run(flow, names, responses.batch, metrics, responses.done)
        finally:
            self.loop.global_step = self._updates
        self._updates = self.loop.global_step = step
        responses.batch, responses.trained_at = batch, step
        responses.busy_s += time.perf_counter() - started
        self._step_metrics(batch, metrics, responses.busy_s, responses.scored_by)
        self.tracker.log(step, metrics)
        self.last_metrics = metrics
        return metrics

    def _step_metrics(
        self, batch: Batch, metrics: dict[str, float], seconds: float, scored_by: Callable[[], str]
    ) -> None:
        """The step's data, throughput and memory metrics, as the dataflow adds them; ``seconds``: the step's
        time, its generate, score and update calls together (the dataflow's whole step in ``RLTrainer``)."""
        memory = self.components.actor.memory()
        metrics.update(memory)
        metrics.update(compute_data_metrics(batch, self.cfg.data.max_response_length))
        metrics.update(throughput_metrics(batch, seconds, self.cfg.trainer.world_size))
        metrics.update(step_peak_memory(memory))
        self.loop.clip_watch.update(metrics)
        self.loop.signal_watch.update(metrics, scored_by)

    def _check_trainable(self, responses: Responses, allow_stale: bool) -> None:
        """Refuse responses trained on already, sampled by an older policy (unless allowed), or a step past
        ``max_steps``."""
        if responses.trained_at is not None:
            raise UserError(
                f"these responses trained the actor already (step {responses.trained_at}); a second update on "
                "them trains nothing new: call generate() for new responses"
            )
        if responses.sampled_at != self._updates + 1 and not allow_stale:
            raise UserError(
                f"these responses were sampled at step {responses.sampled_at}, but the actor has been updated "
                f"{self._updates - responses.sampled_at + 1} time(s) since (it is at step {self._updates}); "
                "call generate() for responses of the current policy, or pass update_actor(..., "
                "allow_stale=True) to train on them off-policy"
            )
        limit = self.cfg.trainer.total_training_steps
        if limit is not None and self._updates >= limit:
            raise UserError(
                f"max_steps={limit} reached (step {self._updates} of {limit}); it sizes the run's schedule "
                "and its step line: raise max_steps= to train longer"
            )

    def _scorer(self, fn: Callable | None, batch: Batch) -> Scorer:
        """The scorer of ``fn`` (built once per function), else the trainer's; refused when there is none."""
        if fn is not None:
            shape = recognise_reward(fn)
            if id(fn) not in self._scorers:
                scorer = Scorer(build_reward_manager(self.cfg, shape), self.tokenizer, self.cfg, None)
                self._scorers[id(fn)] = (fn, scorer)  # the function is kept: its id stays its own
            if shape.needs_ground_truth:
                _require_truth(batch, shape.name)
            return self._scorers[id(fn)][1]
        if self.reward is not None or has_scorer(self.cfg):
            return self.components.scorer
        sources = set(batch["data_source"])
        if sources <= set(known_sources()):  # the built-in scorers (gsm8k, math, ...) read the ground truth
            _require_truth(batch, "the built-in scorer")
            return self.components.scorer
        raise UserError(
            "critic_score needs a reward: pass reward_fn= to Trainer (or reward.model.enable=true), a function "
            "to critic_score(responses, fn) or update_actor(responses, fn), or give update_actor the scores "
            f"as a list (no built-in scorer for data_source {sorted(sources - set(known_sources()))})"
        )

    def save(self, hf_dir: str | Path | None = None) -> Path:
        """A resumable checkpoint (``{run_dir}/global_step_N``); with ``hf_dir`` the policy as an HF model too."""
        path = save_checkpoint(self.loop, self.last_metrics or None)
        if hf_dir is not None:
            self.components.groups[0].run_all("save_hf_model", str(hf_dir))
        return path

    def close(self) -> None:
        """Close the metrics file, stop the workers and reward pools, and free the run directory."""
        self.tracker.close()
        for _, scorer in self._scorers.values():
            scorer.close()
        self.components.close()
        if self._lock is not None:
            self._lock.release()


def _configure(setup: Setup, resume: Resume) -> tuple[Config, Any, int]:
    """The step-wise run's config and layout, and its prompt limit (``api.lengths``)."""
    base = setup.config()
    limit = lengths.position_limit(base)
    extra: dict[str, Any] = {}
    if not setup.is_set(lengths.RESPONSE):
        extra[lengths.RESPONSE] = lengths.default_response_length(limit)
    response = extra.get(lengths.RESPONSE, base.data.max_response_length)
    if not setup.is_set(lengths.PROMPT):
        cap = lengths.prompt_cap(limit, response)
        extra[lengths.PROMPT] = cap if cap is not None else base.data.max_prompt_length
    extra.update(run_dir_settings(base, setup.is_set, resume))
    cfg, layout = plan(setup, setup.config(extra))
    own = lengths.PROMPT in extra  # the API's limit: longer prompts are filtered out, not refused
    return cfg, layout, cfg.data.max_prompt_length if own else None


def _check_step_wise(cfg: Config) -> None:
    """Refuse settings the caller's loop cannot have: dynamic sampling, a schedule with no end."""
    if cfg.algorithm.filter_groups.enable:
        raise UserError(
            "algorithm.filter_groups (DAPO's dynamic sampling) draws more prompts from the dataflow's own "
            "sampler, which the step-wise Trainer has not; use RLTrainer, or filter groups in your loop"
        )
    if cfg.trainer.total_training_steps is not None:
        return
    for role in ("actor", "critic") if cfg.use_critic else ("actor",):
        optim = getattr(cfg, role).optim
        if optim.lr_scheduler_type != "constant" or (
            optim.lr_warmup_steps < 0 and optim.lr_warmup_steps_ratio
        ):
            raise UserError(
                f"{role}.optim: a cosine schedule or a warm-up ratio needs the run's length; pass max_steps= "
                f"(or set {role}.optim.lr_warmup_steps)"
            )


def _check_responses(responses: Any) -> None:
    if not isinstance(responses, Responses):
        raise UserError(f"expected the Responses that generate() returned, got {type(responses).__name__}")


def check_scores(rewards: Any, n: int) -> torch.Tensor:
    """One finite number per response as a (n,) float tensor; a UserError naming the first bad entry."""
    if torch.is_tensor(rewards) or isinstance(rewards, np.ndarray):
        if rewards.ndim != 1:
            raise UserError(f"rewards has shape {tuple(rewards.shape)}; give one score per response, ({n},)")
        rewards = rewards.tolist()
    if isinstance(rewards, (str, bytes)) or not isinstance(rewards, Iterable):
        raise UserError(
            f"rewards is a {type(rewards).__name__}; give one number per response (a list, tensor or array), "
            "a reward function, or critic_score's result"
        )
    values = list(rewards)
    if len(values) != n:
        raise UserError(f"rewards has {len(values)} entries for {n} responses; give one per response")
    for i, v in enumerate(values):
        if torch.is_tensor(v) and v.numel() == 1:
            v = v.item()
        if not isinstance(v, numbers.Real):
            raise UserError(
                f"rewards[{i}] is {v!r} ({type(v).__name__}), not a number; give one float per response"
            )
        if not math.isfinite(float(v)):
            raise UserError(
                f"rewards[{i}] is {float(v)}: a score must be finite; fix the scoring of response {i}"
            )
        values[i] = float(v)
    return torch.tensor(values, dtype=torch.float32)


def _require_truth(batch: Batch, who: str) -> None:
    """Refuse a scorer that reads the ground truth when a prompt of the batch has none."""
    missing = [int(p) for p, g in zip(batch[POSITION], batch["ground_truth"]) if g is None]
    if missing:
        raise UserError(
            f"{who} reads each prompt's ground truth, but prompt {missing[0]} of the generate call has none; "
            "give rows with reward_model.ground_truth (or a ground_truth column), or a reward that needs none"
        )


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


class _SaidOnce(logging.Filter):
    """Drops an INFO notice of the datasets that this Trainer said already (counts aside).

    Every ``generate`` reads its prompts as a small dataset of its own, so each call would repeat how rows
    become prompts; a notice of a new kind still shows, and warnings (prompts filtered out, ...) always do.
    """

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        kind = re.sub(r"\d+", "N", record.getMessage())
        new = kind not in self.said
        self.said.add(kind)
        return new

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The filter on the data loggers for the block."""
        loggers = [logging.getLogger(f"hybridflow.data.{name}") for name in DATA_LOGGERS]
        for log in loggers:
            log.addFilter(self)
        try:
            yield
        finally:
            for log in loggers:
                log.removeFilter(self)
