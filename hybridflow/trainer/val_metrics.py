"""Validation statistics over the n samples of each prompt: mean, best, worst, majority vote and pass@k."""

from __future__ import annotations

from collections import Counter
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_for(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def group_stats(scores: list[float], answers: list[str], correct: list[bool]) -> dict[str, float]:
    """Statistics of one prompt's n samples; the majority vote picks the most frequent answer (ties: first)."""
    n = len(scores)
    votes = Counter(answers)
    top = max(votes.values())
    winner = next(a for a in answers if votes[a] == top)  # first answer reaching the top count
    stats = {
        f"reward/mean@{n}": sum(scores) / n,
        f"reward/best@{n}": max(scores),
        f"reward/worst@{n}": min(scores),
        f"reward/maj@{n}": scores[answers.index(winner)],
        f"acc/mean@{n}": sum(correct) / n,
    }
    for k in ks_for(n) if n > 1 else []:
        stats[f"acc/pass@{k}"] = pass_at_k(n, sum(correct), k)
    return stats


def validation_metrics(
    data_sources: list[str], scores: list[float], answers: list[str], correct: list[bool], n: int, prefix: str
) -> dict[str, float]:
    """``{prefix}/{data_source}/...`` averaged over prompts; samples arrive as n consecutive rows per prompt."""
    if len(scores) % n:
        raise ValueError(f"{len(scores)} samples are not a multiple of n={n}")
    sums: dict[str, dict[str, float]] = {}
    counts: Counter[str] = Counter()
    for start in range(0, len(scores), n):
        group = slice(start, start + n)
        ds = data_sources[start]
        counts[ds] += 1
        for key, value in group_stats(scores[group], answers[group], correct[group]).items():
            sums.setdefault(ds, {}).setdefault(key, 0.0)
            sums[ds][key] += value
    return {
        f"{prefix}/{ds}/{key}": total / counts[ds]
        for ds, stats in sums.items()
        for key, total in stats.items()
    }
