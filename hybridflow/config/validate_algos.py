"""Checks of a Config's algorithm settings: the rollout correction, the policy loss and what the advantage
estimator needs (``validate`` runs them with the rest); every problem names the field and the fix."""

from __future__ import annotations

from typing import Any

from hybridflow.config.choices import ADV_ESTIMATORS, UNFED_ADV_ESTIMATORS
from hybridflow.config.errors import Problem
from hybridflow.config.rollout_correction import (
    accepted_rollout_rs,
    is_threshold_problem,
    rs_threshold_problem,
    split_rollout_rs,
)
from hybridflow.config.schema import Config
from hybridflow.config.schema_base import get_path

_RC = "algorithm.rollout_correction"


def _check_rc_specs(rc: Any, prefix: str, out: list[Problem]) -> list[str]:
    """The IS threshold, rejection options and thresholds of the rollout-correction section at ``prefix``;
    returns the canonical rejection options (empty when off or unusable)."""
    problem = is_threshold_problem(rc.rollout_is_threshold)
    if problem is not None:
        out.append(
            Problem(
                f"{prefix}.rollout_is_threshold",
                problem,
                f"e.g. {prefix}.rollout_is_threshold=2.0 or '0.5_5.0'",
            )
        )
    options: list[str] = []
    if rc.rollout_rs is not None:
        options, unknown = split_rollout_rs(rc.rollout_rs)
        if unknown or not options:
            out.append(
                Problem(
                    f"{prefix}.rollout_rs",
                    f"unknown option(s) {', '.join(repr(u) for u in unknown) or repr(rc.rollout_rs)}",
                    f"use {accepted_rollout_rs()}, or null for no rejection",
                )
            )
            options = []
    if rc.rollout_rs is not None and rc.rollout_rs_threshold is None:  # set on a Config after it was built
        out.append(
            Problem(
                f"{prefix}.rollout_rs_threshold",
                f"is null while {prefix}.rollout_rs={rc.rollout_rs!r}",
                f"set {prefix}.rollout_rs_threshold={rc.rollout_is_threshold} (rollout_is_threshold, its "
                f"documented default), or {prefix}.rollout_rs=null",
            )
        )
    elif options:
        problem = rs_threshold_problem(options, rc.rollout_rs_threshold)
        if problem is not None:
            out.append(
                Problem(
                    f"{prefix}.rollout_rs_threshold",
                    problem,
                    "give 'lower_upper' ratio bounds (or one number u for 1/u_u) to k1 options and one upper "
                    "bound to k2/k3 options, comma separated in the order of rollout_rs",
                )
            )
    return options


def check_rollout_correction(cfg: Config, out: list[Problem]) -> None:
    rc = cfg.algorithm.rollout_correction
    options = _check_rc_specs(rc, _RC, out)
    lower = rc.rollout_rs_threshold_lower
    if lower is not None:  # left over: __post_init__ folds every usable value into rollout_rs_threshold
        if not lower > 0:
            why = f"must be greater than 0, got {lower!r}"
        elif not (options and all(o.endswith("k1") for o in options)):
            why = f"applies to k1 options only, not to rollout_rs={rc.rollout_rs!r}"
        elif not isinstance(rc.rollout_rs_threshold, int | float):
            why = f"cannot be combined with the string rollout_rs_threshold={rc.rollout_rs_threshold!r}"
        else:
            why = f"{lower} is not below the upper threshold {rc.rollout_rs_threshold}"
        out.append(
            Problem(
                f"{_RC}.rollout_rs_threshold_lower",
                why,
                f"leave it null and give bounds as {_RC}.rollout_rs_threshold='lower_upper' (verl 0.9.1: bounds "
                "on pi_rollout / pi_train)",
            )
        )
    # Accepted for verl configs, not built yet: refuse rather than ignore them silently.
    for name, value in (
        ("rollout_token_veto_threshold", rc.rollout_token_veto_threshold),
        ("use_pure_rollout_correction", rc.use_pure_rollout_correction or None),
    ):
        if value is not None:
            out.append(
                Problem(
                    f"algorithm.rollout_correction.{name}",
                    f"{value} asks for a feature hybridflow does not implement yet",
                    "leave it unset; rollout_is and rollout_rs are available",
                )
            )


_PL = "actor.policy_loss"


def check_policy_loss(cfg: Config, out: list[Problem]) -> None:
    """The settings a policy loss needs: dro's beta, bypass_mode's rollout log-probs and its thresholds."""
    pl = cfg.actor.policy_loss
    if pl.loss_mode == "dro" and pl.dro_beta is None:
        out.append(
            Problem(
                f"{_PL}.dro_beta",
                f"is null, but {_PL}.loss_mode=dro needs its quadratic log-ratio penalty (a number > 0)",
                f"set {_PL}.dro_beta to a positive number, e.g. {_PL}.dro_beta=0.1",
            )
        )
    _check_rc_specs(pl.rollout_correction, f"{_PL}.rollout_correction", out)
    bypass = "algorithm.rollout_correction.bypass_old_logprob_for_rollout"
    if pl.loss_mode == "bypass_mode" and not get_path(cfg, bypass):
        out.append(
            Problem(
                f"{_PL}.loss_mode",
                f"is bypass_mode, which takes the old log-probs for the rollout's, but {bypass}=false "
                "recomputes them with the trainer",
                f"set {bypass}=true (verl's bypass mode), or pick another {_PL}.loss_mode",
            )
        )


def check_adv_estimator_inputs(cfg: Config, out: list[Problem]) -> None:
    """Estimators whose inputs the PPO trainer does not compute are refused at start, not at step 1."""
    name = cfg.algorithm.adv_estimator
    if name in UNFED_ADV_ESTIMATORS:
        usable = [n for n in ADV_ESTIMATORS if n not in UNFED_ADV_ESTIMATORS]
        out.append(
            Problem(
                "algorithm.adv_estimator",
                f"{name} needs a per-token sum_pi_squared (the sum over the vocabulary of pi^2), which the "
                "actor does not compute yet",
                f"use one of: {', '.join(usable)}; the function stays callable from hybridflow.algos",
            )
        )


# An empty list is refused: null is how to ask for the built-in task (or, for val_files, for no files).
