"""The rollout-correction settings' names and threshold specs: aliases mapped, bad values explained.

Config (L1) cannot import ``hybridflow.algos`` (L2), so the accepted names live in ``choices`` and the
threshold grammar is checked here; ``hybridflow.algos.rollout_correction`` applies the same rules.
"""

from __future__ import annotations

from hybridflow.config.choices import ROLLOUT_RS_ALIASES, ROLLOUT_RS_OPTIONS

RC = "algorithm.rollout_correction"


def accepted_rollout_rs() -> str:
    """The accepted rollout_rs names, for error messages."""
    aliases = ", ".join(f"{old}={new}" for old, new in ROLLOUT_RS_ALIASES.items())
    return f"{', '.join(ROLLOUT_RS_OPTIONS)}, comma-chained (older aliases: {aliases})"


def split_rollout_rs(value: str) -> tuple[list[str], list[str]]:
    """``(options, unknown)``: the canonical options of a comma-chained value (deduplicated), and bad names."""
    options: list[str] = []
    unknown: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        option = ROLLOUT_RS_ALIASES.get(part, part)
        if option not in ROLLOUT_RS_OPTIONS:
            unknown.append(part)
        elif option not in options:
            options.append(option)
    return options, unknown


def canonical_rollout_rs(value: str | None) -> str | None:
    """verl 0.9.1's spelling of ``value`` (``token`` -> ``token_k1``, ...); unknown names are left as given."""
    if not isinstance(value, str):
        return value
    options, unknown = split_rollout_rs(value)
    return value if unknown or not options else ",".join(options)


def _bounds(text: str) -> tuple[float, float | None]:
    """``(upper, lower)`` of a number or a ``"lower_upper"`` string; raises ValueError."""
    if "_" in text:
        low, up = text.split("_", 1)
        return float(up), float(low)
    return float(text), None


def is_threshold_problem(spec: float | str) -> str | None:
    """Why ``rollout_is_threshold`` is unusable, or None."""
    try:
        upper, lower = _bounds(spec.strip()) if isinstance(spec, str) else (float(spec), None)
    except ValueError:
        return f"{spec!r} is neither a number (TIS upper bound) nor a 'lower_upper' string (IcePop)"
    if not upper > 0:
        return f"upper bound must be > 0, got {spec!r}"
    if lower is not None and not 0 < lower <= upper:
        return f"lower bound must be in (0, upper], got {spec!r}"
    return None


def rs_threshold_problem(options: list[str], spec: float | str) -> str | None:
    """Why ``rollout_rs_threshold`` does not fit ``options``, or None."""
    entries = [p.strip() for p in spec.split(",") if p.strip()] if isinstance(spec, str) else [str(spec)]
    if len(entries) == 1:
        entries = entries * len(options)
    if len(entries) != len(options):
        return f"{spec!r} must hold one threshold for all options or one per option ({', '.join(options)})"
    for option, entry in zip(options, entries):
        k1 = option.endswith("k1")
        if "_" in entry and not k1:
            return f"{entry!r} for {option}: k2/k3 options take one upper bound, not 'lower_upper'"
        try:
            upper, lower = _bounds(entry)
        except ValueError:
            return f"{entry!r} for {option} is not a number" + (" or a 'lower_upper' string" if k1 else "")
        if k1 and lower is None and upper > 0:
            lower = 1.0 / upper
        if not upper > 0 or (lower is not None and not 0 < lower <= upper):
            return f"{entry!r} for {option}: bounds must be positive with lower <= upper"
    return None


def translate_lower(upper: float, lower: float) -> str:
    """The verl 0.9.1 spec equal to our older ``[lower, upper]`` bounds on pi_train / pi_rollout (k1 only).

    verl's k1 bounds apply to ``exp(k1) = pi_rollout / pi_train``, the reciprocal: ``1/upper_1/lower``.
    """
    return f"{1.0 / upper!r}_{1.0 / lower!r}"
