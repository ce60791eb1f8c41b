"""``hybridflow train`` with no arguments: a tiny model learns arithmetic by SFT, then improves by GRPO.

1. Build a tiny model (Qwen2 architecture, or `model.tiny_arch`) and a character tokenizer (no download).
2. Warm it up with a short SFT on the built-in arithmetic task's reference answers.
3. Measure greedy accuracy on held-out problems.
4. Run GRPO with the exact-match reward.
5. Measure greedy accuracy again and print both.
Everything lands in the run directory (configs, models, metrics.jsonl, curves.png).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

from hybridflow.config import Config, ConfigError, Problem, load_config, parse_overrides
from hybridflow.config.aliases import resolve_alias
from hybridflow.data import collate_prompts, load_split_rows
from hybridflow.data.tasks import TOOL_TASKS
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.trainer.builder import build_preference_components, load_policy
from hybridflow.trainer.dumps import decode_responses
from hybridflow.trainer.jobs import load_components_from, preference_config, preference_job, rl_job, sft_job
from hybridflow.trainer.plotting import read_metrics
from hybridflow.trainer.ppo import prompt_fields
from hybridflow.trainer.tracking import METRICS_FILE
from hybridflow.trainer.validation import validate
from hybridflow.utils.errors import UserError
from hybridflow.utils.progress import counted
from hybridflow.utils.seed import set_seed

logger = logging.getLogger(__name__)

TINY_MODEL = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# The embedded default config of the RL phase (any key can be overridden on the command line).
DEMO_OVERRIDES = [
    "trainer.experiment_name=demo",
    "data.task=arithmetic",
    # Sums of three one-digit numbers ('3+5+2=' -> '#### 10'): 1000 problems, 150 of them held out. A model of
    # 0.8M parameters learns them within a few hundred SFT steps, so a short warm-up leaves room for RL.
    "data.task_kwargs.digits=1",
    "data.task_kwargs.ops=+",
    "data.task_kwargs.terms=3",
    "data.task_kwargs.style=short",
    "data.task_train_size=780",
    "data.task_val_size=150",
    "data.max_prompt_length=48",
    "data.max_response_length=10",
    "data.train_batch_size=32",
    "rollout.n=8",
    "rollout.temperature=1.0",
    "model.use_remove_padding=true",
    "actor.ppo_mini_batch_size=32",
    "actor.ppo_micro_batch_size_per_gpu=256",
    "actor.optim.lr=5e-5",
    "actor.optim.weight_decay=0.0",
    "algorithm.adv_estimator=grpo",
    "trainer.total_training_steps=40",
    "trainer.test_freq=10",
    "trainer.val_before_train=false",
    # The demo starts over each time (its SFT warm-up is not checkpointed); pass trainer.resume=auto to continue.
    "trainer.resume=disable",
]
# The GRPO phase of ``hybridflow train`` sets these on top (the warm-up and the DPO demo do not).
GRPO_OVERRIDES = [
    # Sampling at 0.6 keeps a group's answers varied (GRPO learns from the groups that disagree) while the
    # sampled reward follows what the policy knows; at 1.0 it stayed near 0.4 while greedy accuracy climbed.
    "rollout.temperature=0.6",
    # Four optimizer steps per batch of rollouts (mini-batches of 8 prompts x 8 samples, clipped against the
    # rollout's log-probs): the update is cheap next to generation here, so the same samples teach more.
    "actor.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size_per_gpu=64",
    "actor.optim.lr=1e-4",
    # GRPO's usual KL loss to the reference (the SFT model, low_var_kl, coefficient 0.001): the KL it optimises.
    "actor.use_kl_loss=true",
    # Held-out accuracy at step 0 too: the before/after table and the reward panel read it from the run.
    "trainer.val_before_train=true",
]
# The SFT warm-up differs only in these keys (and its run directory: ``demo_configs``).
SFT_OVERRIDES = [
    "trainer.save_freq=0",  # the warm-up is not checkpointed: the demo starts over each time
    "actor.optim.lr=3e-3",
    "actor.optim.lr_scheduler_type=cosine",
    "actor.optim.lr_warmup_steps=10",
    "actor.optim.min_lr_ratio=0.3",
    "data.train_batch_size=64",
    "actor.ppo_micro_batch_size_per_gpu=64",
    "trainer.total_training_steps=165",
]


SFT_RUN = "sft_run"  # the warm-up's run directory, inside the demo's

# ``hybridflow dpo`` with no config: the same warm-up, then DPO on pairs built from the task's training
# problems: the reference answer against the warm model's own wrong answer.
DPO_OVERRIDES = [
    "trainer.experiment_name=dpo_demo",
    "preference.beta=0.1",
    # DPO alone lowers this model's greedy accuracy: chosen and rejected differ in one or two digit tokens,
    # and the contrastive loss pushes probability off both (likelihood displacement). An NLL term on the
    # chosen side (RPO-style) keeps it; benchmarks/RESULTS.md has the ablation.
    "preference.sft_coef=1.0",
    "actor.optim.lr=5e-5",
    "actor.ppo_micro_batch_size_per_gpu=64",
    "trainer.total_training_steps=40",
]


def demo_task(overrides: list[str]) -> str | None:
    """The built-in task the user's overrides name (``data.task=...``), or None."""
    found = _texts_by_path(overrides).get("data.task")
    return found.split("=", 1)[1].strip() if found else None


def accuracy(metrics: dict[str, float]) -> float:
    """The held-out greedy accuracy among validation metrics."""
    return next(v for k, v in metrics.items() if k.endswith("/acc/mean@1"))


def logged_accuracy(records: list[dict[str, Any]], step: int) -> float | None:
    """The held-out greedy accuracy that a run's metrics lines hold for ``step`` (None if not validated)."""
    for record in records:
        if record["step"] == step:
            values = [v for k, v in record.items() if k.endswith("/acc/mean@1") and v is not None]
            if values:
                return float(values[0])
    return None


def _texts_by_path(overrides: list[str]) -> dict[str, str]:
    """Our field path -> the ``key=value`` text, for each override (the last one of a field wins)."""
    pairs = parse_overrides(overrides)
    return {resolve_alias(key)[0]: text.strip() for (key, _), text in zip(pairs, overrides)}


def _mentions(text: str, path: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(path)}(?!\w)", text) is not None


def _own_values(problem: Problem, demo: dict[str, str], user: dict[str, str]) -> Problem:
    """``problem`` saying which of the values it quotes are the demo's own settings, and which the user's."""
    text = f"{problem.path} {problem.message} {problem.fix}"
    ours = sorted((p for p in demo if _mentions(text, p)), key=lambda p: p != problem.path)
    if not ours:
        return problem
    yours = [user[p] for p in user if _mentions(text, p)]
    note = f"the demo sets {', '.join(demo[p] for p in ours)}" + (
        f"; you set {', '.join(yours)}" if yours else ""
    )
    return dataclasses.replace(problem, message=f"{problem.message} [{note}]")


def _demo_config(settings: list[str], overrides: list[str], last: list[str]) -> Config:
    """The demo's ``settings``, then the user's ``overrides``, then ``last`` (which win over the user's)."""
    final = _texts_by_path(last)
    user = {p: t for p, t in _texts_by_path(overrides).items() if p not in final}
    demo = {p: t for p, t in _texts_by_path(settings).items() if p not in user} | final
    try:
        return load_config(None, settings + overrides + last)
    except ConfigError as exc:
        raise ConfigError([_own_values(p, demo, user) for p in exc.problems]) from None


def demo_configs(
    overrides: list[str],
    sft_overrides: list[str] | None = None,
    extra: list[str] | None = None,
    rl_extra: list[str] | None = None,
    base: list[str] | None = None,
) -> tuple[Config, Config]:
    """The configs of the demo's RL phase and of its SFT warm-up, with the user's ``overrides``.

    ``base`` replaces the demo's task settings (``DEMO_OVERRIDES``; the tool demo has its own).
    ``extra`` adds demo settings to both, ``rl_extra`` to the RL phase only. A problem says which of the
    values it quotes are the demo's own. The warm-up has no mini-batches: its ``actor.ppo_mini_batch_size``
    is its batch, so the RL phase's batch settings never fail its checks. The warm-up keeps its records
    (config.yaml, metrics.jsonl, curves.png) in ``sft_run`` inside the RL phase's run directory.
    """
    settings = list(DEMO_OVERRIDES if base is None else base) + list(extra or [])
    cfg = _demo_config(settings + list(rl_extra or []), list(overrides), [])
    # The command line's overrides configure the RL phase; the warm-up keeps its own SFT settings.
    sft = SFT_OVERRIDES + list(sft_overrides or [])
    batch = dict(parse_overrides(sft)).get("data.train_batch_size", cfg.data.train_batch_size)
    sft_cfg = _demo_config(settings, list(overrides), [*sft, f"actor.ppo_mini_batch_size={batch}"])
    sft_cfg.trainer.default_local_dir = str(Path(cfg.trainer.run_dir()) / SFT_RUN)
    return cfg, sft_cfg


def warm_up(
    overrides: list[str],
    sft_overrides: list[str] | None,
    extra: list[str],
    rl_extra: list[str] | None = None,
    base: list[str] | None = None,
) -> tuple[Any, Path]:
    """Build the tiny model and SFT it on the task's reference answers; returns (config, run directory)."""
    cfg, sft_cfg = demo_configs(overrides, sft_overrides, extra, rl_extra, base)
    run_dir = Path(cfg.trainer.run_dir())
    set_seed(cfg.trainer.seed, cfg.trainer.deterministic)
    model, tokenizer = build_tiny_model_and_tokenizer(
        run_dir / "base_model", arch=cfg.model.tiny_arch, seed=cfg.trainer.seed, **TINY_MODEL
    )
    logger.info("demo: SFT warm-up for %s", counted(sft_cfg.trainer.total_training_steps, "step"))
    rows = load_split_rows(sft_cfg.data, "train", sft_cfg.trainer.seed)
    sft_job(sft_cfg, run_dir / "sft_model", model, tokenizer, rows)
    cfg.model.path = str(run_dir / "sft_model")
    return cfg, run_dir


def run_demo(overrides: list[str] | None = None, sft_overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the built-in demo; returns accuracies before/after GRPO, the run directory and the history.

    A task answered with a tool (``data.task=multiply``) has its own demo, ``demos.tool_use.run_tool_demo``
    (``hybridflow train data.task=multiply`` runs it).
    """
    task = demo_task(overrides or [])
    if task == "squares":
        raise UserError(
            "data.task=squares is the vision demo: call hybridflow.demos.vision.run_vision_demo (or run "
            "hybridflow train data.task=squares)"
        )
    if task in TOOL_TASKS:
        raise UserError(
            f"data.task={task} is the tool demo: call hybridflow.demos.tool_use.run_tool_demo (or run "
            f"hybridflow train data.task={task})"
        )
    cfg, run_dir = warm_up(overrides or [], sft_overrides, [], GRPO_OVERRIDES)
    components = load_components_from(run_dir / "sft_model", cfg)
    # With trainer.val_before_train (the demo's default) the run validates at step 0 and at its last step.
    before = None if cfg.trainer.val_before_train else accuracy(validate(cfg, components))
    logger.info("demo: GRPO for %s", counted(components.total_steps, "step"))
    history = rl_job(cfg, components, log_summary=False)  # the command line logs it after the accuracy table
    records = read_metrics(run_dir / METRICS_FILE)
    if before is None:
        before = logged_accuracy(records, 0)
    after = logged_accuracy(records, components.total_steps)
    if after is None:
        after = accuracy(validate(cfg, components))
    components.close()
    return {
        "before": before,
        "after": after,
        "run_dir": run_dir,
        "history": history,
        "num_val": len(components.val),
    }


def grpo_from_warm_up(cfg: Config, run_dir: Path, what: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """GRPO from the warmed-up ``run_dir/sft_model`` (a demo's second phase): held-out accuracy at step 0 and at
    the last step, the run directory, history and validation size; and the run's metrics records."""
    components = load_components_from(run_dir / "sft_model", cfg)
    logger.info("%s: GRPO for %s", what, counted(components.total_steps, "step"))
    history = rl_job(cfg, components, log_summary=False)  # the command line logs it after the accuracy table
    records = read_metrics(run_dir / METRICS_FILE)
    last = components.total_steps
    components.close()
    result = {
        "before": logged_accuracy(records, 0),
        "after": logged_accuracy(records, last),
        "run_dir": run_dir,
        "history": history,
        "num_val": len(components.val),
        "last_step": last,
    }
    return result, records


def sampled_pairs(cfg: Any, components: Any, samples: int = 4) -> list[dict[str, Any]]:
    """DPO pairs from the policy's own mistakes: for each training problem, ``samples`` answers at
    temperature 1; the reference answer is ``chosen`` and the first wrong sample ``rejected``. Problems the
    policy always solves give no pair (there is nothing to prefer against)."""
    c = components
    params = c.actor.sampling_params(samples, 1.0, 1.0, -1, True, c.eos_token_ids, seed=cfg.trainer.seed)
    pairs = []
    for start in range(0, len(c.train), 128):
        items = [c.train[i] for i in range(start, min(start + 128, len(c.train)))]
        prompts = collate_prompts(items, c.pad_token_id)
        batch = c.actor.generate(prompt_fields(prompts), params, desc="negatives")
        for key in ("data_source", "ground_truth", "extra_info"):
            batch[key] = prompts[key].repeat(samples)
        scores, _ = c.scorer.score(batch)  # (len(items) * samples,)
        texts = decode_responses(c.tokenizer, batch)
        for j, item in enumerate(items):
            wrong = [texts[j * samples + k] for k in range(samples) if scores[j * samples + k] <= 0]
            if wrong:
                chosen = item["extra_info"]["answer"]
                pairs.append({"prompt": item["raw_prompt"], "chosen": chosen, "rejected": wrong[0]})
    logger.info("demo: %d preference pairs from the policy's wrong samples", len(pairs))
    return pairs


def run_dpo_demo(
    overrides: list[str] | None = None, sft_overrides: list[str] | None = None
) -> dict[str, Any]:
    """``hybridflow dpo`` with no config: SFT warm-up, then DPO against the warm model's own wrong answers."""
    cfg, run_dir = warm_up(overrides or [], sft_overrides, DPO_OVERRIDES)
    sampler = load_components_from(run_dir / "sft_model", cfg)
    before = accuracy(validate(cfg, sampler))
    rows = sampled_pairs(cfg, sampler)
    sampler.close()
    pcfg = preference_config(cfg)
    model, tokenizer = load_policy(pcfg)
    components = build_preference_components(pcfg, "dpo", model, tokenizer, rows=rows)
    logger.info(
        "demo: held-out accuracy after SFT %.1f%%; DPO for %s",
        100 * before,
        counted(components.total_steps, "step"),
    )
    history = preference_job(pcfg, "dpo", components, log_summary=False)
    after = accuracy(validate(pcfg, components))
    components.close()
    return {
        "before": before,
        "after": after,
        "run_dir": run_dir,
        "history": history,
        "num_val": len(components.val),
    }


def format_table(result: dict[str, Any], algorithm: str = "GRPO") -> str:
    """The before/after table printed at the end of the demo."""
    n = result["num_val"]
    calls = []  # the tool demo's held-out tool calls per episode, before and after
    if result.get("calls_before") is not None and result.get("calls_after") is not None:
        calls = [
            f"held-out tool calls per episode: {result['calls_before']:.2f} -> {result['calls_after']:.2f}"
        ]
    return "\n".join(
        [
            f"held-out greedy accuracy ({n} problems)",
            "  stage          accuracy",
            f"  after SFT      {100 * result['before']:6.1f}%",
            f"  after {algorithm:<9}{100 * result['after']:6.1f}%",
            f"  change         {100 * (result['after'] - result['before']):+6.1f} points",
            *calls,
            f"run directory: {result['run_dir']}",
        ]
    )
