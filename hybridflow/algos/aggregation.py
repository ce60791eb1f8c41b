"""Loss aggregation: reduce a per-token loss matrix to the scalar that ``backward()`` sees.

Every mode is written as ``sum over the micro-batch / (count over the whole mini-batch) * dp_size``, so
that, given the mini-batch counts, the result is additive over micro-batches and data-parallel ranks: the
gradient of an optimizer step does not depend on how the mini-batch was split. Unlike verl's legacy
actor (which divides each micro-batch by its own token count and then by the number of micro-batches),
``token-mean`` is therefore a true global mean over the mini-batch.
"""

from __future__ import annotations

import torch

from hybridflow.utils.torch_functional import masked_sum

# verl's four modes plus "token-sum" (added to verl's agg_loss in 2026, before the 0.9 releases).
LOSS_AGG_MODES: list[str] = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]

Count = int | float | torch.Tensor


def _check_count(name: str, value: Count | None) -> None:
    """Reject counts that are not numbers or are negative (a tensor is trusted: checking it would sync)."""
    if value is None or isinstance(value, torch.Tensor):
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"agg_loss: {name} must be an int, float or tensor, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"agg_loss: {name} must be >= 0, got {value}")


def _check_args(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    dp_size: int,
    batch_num_tokens: Count | None,
    global_batch_size: Count | None,
    loss_scale_factor: Count | None,
) -> None:
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"agg_loss: loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must have the "
            "same shape (batch, response_length)"
        )
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"agg_loss: dp_size must be an int >= 1 (data-parallel world size), got {dp_size!r}")
    _check_count("batch_num_tokens", batch_num_tokens)
    _check_count("global_batch_size", global_batch_size)
    _check_count("loss_scale_factor", loss_scale_factor)
    if (
        loss_scale_factor is not None
        and not isinstance(loss_scale_factor, torch.Tensor)
        and loss_scale_factor == 0
    ):
        raise ValueError("agg_loss: loss_scale_factor must be > 0, e.g. the maximum response length")


def _safe_denominator(count: Count) -> Count:
    """A zero count means nothing is valid; the numerator is then 0 too, so divide by 1 instead of 0."""
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, count, torch.ones_like(count))
    return count if count > 0 else 1


def _require_global(name: str, loss_agg_mode: str, dp_size: int) -> None:
    raise ValueError(
        f"agg_loss(loss_agg_mode={loss_agg_mode!r}, dp_size={dp_size}) needs {name}: the count over the whole "
        f"mini-batch, summed over all {dp_size} data-parallel ranks and all micro-batches. Without it each "
        "rank would normalise by its own local count and the gradient would depend on the data split. "
        f"Pass {name}= (see local_batch_info) or dp_size=1 for single-process use."
    )


def _sequence_losses(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, loss_scale_factor: Count | None
) -> torch.Tensor:
    """Per-sequence loss for the seq-mean-* modes; fully masked rows give exactly 0."""
    seq_sums = masked_sum(loss_mat, loss_mask, axis=-1)  # (B,)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums
    if loss_agg_mode == "seq-mean-token-mean":
        token_counts = loss_mask.sum(dim=-1)  # (B,)
        return seq_sums / _safe_denominator(token_counts)
    # seq-mean-token-sum-norm (Dr. GRPO): a constant divisor instead of each sequence's own length.
    if loss_scale_factor is None:
        loss_scale_factor = loss_mask.shape[-1]
    return seq_sums / loss_scale_factor


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Count | None = None,
    global_batch_size: Count | None = None,
    loss_scale_factor: Count | None = None,
) -> torch.Tensor:
    """Aggregate a ``(B, T)`` loss matrix into a scalar so that micro-batch results add up to the mini-batch loss.

    Modes (``m`` the mask, ``l`` the loss, ``N`` = ``batch_num_tokens``, ``S`` = ``global_batch_size``):

    - ``token-mean``: ``sum(l * m) / N * dp_size``; every valid token of the mini-batch weighs the same.
    - ``token-sum``: ``sum(l * m) * dp_size``; no normalisation at all.
    - ``seq-mean-token-sum``: ``sum_i sum_t(l * m) / S * dp_size``.
    - ``seq-mean-token-mean``: ``sum_i [sum_t(l * m) / sum_t(m)] / S * dp_size``.
    - ``seq-mean-token-sum-norm``: ``sum_i [sum_t(l * m) / loss_scale_factor] / S * dp_size`` (Dr. GRPO);
      ``loss_scale_factor`` defaults to ``T = loss_mask.shape[-1]``.

    Defaults: ``N`` = valid tokens in ``loss_mask``; ``S`` = rows of ``loss_mask`` with at least one valid
    token. Fully masked rows contribute nothing, to the numerator or to the default ``S``; a count of 0
    gives a loss of 0, never NaN. With ``dp_size > 1`` the count the mode needs must be given.

    How the trainer combines micro-batches (one optimizer step over one mini-batch):

    1. Before the micro-batch loop, count over the WHOLE mini-batch, all ranks and all micro-batches:
       ``N`` = valid tokens and ``S`` = sequences with at least one valid token (sum
       ``local_batch_info`` over micro-batches, then all-reduce SUM over the data-parallel group).
    2. For each micro-batch call ``agg_loss`` with these global ``N``/``S``, the same ``dp_size`` and a
       constant ``loss_scale_factor`` (e.g. the max response length; the default ``T`` changes with each
       micro-batch's padding and then breaks split invariance), and call ``backward()`` on the result
       as is: gradients accumulate as a SUM over micro-batches. Do not divide by the number of
       micro-batches (no ``1 / gradient_accumulation`` factor).
    3. FSDP/DDP average gradients over the ``dp_size`` ranks; the ``* dp_size`` factor cancels that
       average, so the step's gradient equals the gradient of the unsplit mini-batch loss.
    4. To log the mini-batch loss: sum the results over micro-batches on each rank, then average over
       ranks (on a single rank, the sum is the loss).
    """
    _check_args(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    if loss_agg_mode in ("token-mean", "token-sum"):
        total = masked_sum(loss_mat, loss_mask)  # ()
        if loss_agg_mode == "token-sum":
            return total * dp_size
        if batch_num_tokens is None:
            if dp_size > 1:
                _require_global("batch_num_tokens", loss_agg_mode, dp_size)
            batch_num_tokens = loss_mask.sum()
        return total / _safe_denominator(batch_num_tokens) * dp_size

    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode {loss_agg_mode!r}; valid modes are {LOSS_AGG_MODES}")
    seq_losses = _sequence_losses(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor)  # (B,)
    if global_batch_size is None:
        if dp_size > 1:
            _require_global("global_batch_size", loss_agg_mode, dp_size)
        global_batch_size = (loss_mask.sum(dim=-1) > 0).sum()
    return seq_losses.sum() / _safe_denominator(global_batch_size) * dp_size


def local_batch_info(loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Counts of one chunk, to be summed over micro-batches and ranks into ``agg_loss``'s global counts.

    Returns ``batch_num_tokens`` (valid tokens) and ``global_batch_size`` (rows with at least one valid
    token), both 0-dim int64 tensors, matching the defaults ``agg_loss`` uses for a single chunk.
    """
    return {
        "batch_num_tokens": loss_mask.sum().long(),
        "global_batch_size": (loss_mask.sum(dim=-1) > 0).sum().long(),
    }
