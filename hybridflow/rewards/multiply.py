"""Scorer of the built-in ``multiply`` task (answered with the ``calc`` tool): the episode's final answer.

In a multi-turn rollout the trainer decodes the tokens the policy sampled, every assistant turn of the
episode in order (the tool's outputs have response mask 0 and are not part of the text), so the text holds
the calls and the answer, e.g. ``[[calc: 347*581]]#### 201607``. The final answer is the last
``#### <integer>`` of the episode: an answer given before a call and corrected after it counts as corrected.
"""

from __future__ import annotations

from hybridflow.rewards.arithmetic import extract_answer, ground_truth_int


def compute_score(solution_str: str, ground_truth: int | str) -> float:
    """1.0 when the episode's final ``#### <integer>`` equals the product, else 0.0 (no credit for calling)."""
    return 1.0 if extract_answer(solution_str) == ground_truth_int(ground_truth) else 0.0
