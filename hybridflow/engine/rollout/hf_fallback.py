"""Generation through transformers' ``generate`` for architectures the built-in engine does not cover.

Also what ``rollout.engine=hf`` selects, for comparison (``HFRollout``: the built-in engine's ``generate``
interface). The outputs have the same form as the built-in engine's; log-probs come from the processed
scores (after temperature and top-k/top-p/min-p), i.e. the distribution actually sampled from, as in
``sampling.sample``.

RNG: HF ``generate`` samples from torch's global RNG and takes no generator. A seeded call therefore forks
the global state of the CPU and of the model's device, seeds the fork and restores the state afterwards, so
the training RNG is exactly as it was (docs/architecture.md). Forking, rather than re-implementing HF's
sampling with a private generator, keeps this path HF's own sampler, which is what it is compared for. An
unseeded call draws from the global RNG, as the built-in engine does with ``seed=None``. The fork swaps
process-wide state: another thread drawing from the global RNG during a seeded rollout would draw from the
seeded stream and lose its draws (the trainer's only other thread, the async reward, ends with its step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.types import GenerationOutput
from hybridflow.models.vision import is_vision_language, text_config
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)


def _generate_kwargs(params: SamplingParams, pad_id: int) -> dict:
    kw: dict = dict(
        max_new_tokens=params.max_new_tokens,
        pad_token_id=pad_id,
        return_dict_in_generate=True,
        output_scores=True,
    )
    if params.greedy:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kw.update(
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            min_p=params.min_p or None,
        )
    stops = [] if params.ignore_eos else list(params.eos_token_ids)
    stops += list(params.stop_token_ids)
    kw["eos_token_id"] = stops or None
    if params.ignore_eos:
        kw["min_new_tokens"] = params.max_new_tokens
    return kw


@contextlib.contextmanager
def _private_rng(seed: int | None, device: torch.device) -> Iterator[None]:
    """Inside: the global RNGs of the CPU and ``device`` seeded with ``seed``; after: exactly as before."""
    if seed is None:
        yield
        return
    on_device = device.type != "cpu"
    index = device.index if device.index is not None else 0
    devices = [index] if on_device else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if on_device else "cuda"):
        # Seed only the generators forked above: torch.manual_seed would also reseed every other GPU,
        # whose state fork_rng does not restore.
        torch.random.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.default_generators[index].manual_seed(seed)
        elif on_device:
            getattr(torch, device.type).manual_seed(seed)
        yield


def position_limit(model: nn.Module, max_model_len: int | None = None) -> int | None:
    """The most tokens a sequence may hold: the model's position limit, or ``max_model_len`` when smaller."""
    limit = getattr(text_config(getattr(model, "config", None)), "max_position_embeddings", None)
    limits = [n for n in (limit, max_model_len) if isinstance(n, int) and n > 0]
    return min(limits) if limits else None


def response_caps(prompts: list[list[int]], max_new_tokens: int, limit: int | None) -> list[int]:
    """Each prompt's most new tokens: ``max_new_tokens``, cut where prompt + response reaches ``limit``.

    The built-in engine's rule (``DecodeState.start``). Raises UserError for a prompt that leaves no room.
    """
    if limit is None:
        return [max_new_tokens] * len(prompts)
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        raise UserError(
            f"a prompt of {longest} tokens leaves no room to generate within the context of {limit} tokens; "
            "shorten it or raise max_model_len (data.max_prompt_length)"
        )
    return [min(max_new_tokens, limit - len(p)) for p in prompts]


def image_kwargs(
    model: nn.Module, ids: torch.Tensor, rows_mm: list[dict[str, torch.Tensor] | None]
) -> dict[str, torch.Tensor]:
    """HF forward's image arguments for left-padded rows ``ids`` (B, T) whose images are ``rows_mm`` (per row,
    None for text only): the rows' pixel values and grids concatenated in row order, and the image-token
    mask; {} when no row has images. A text model given images is refused (UserError)."""
    if all(mm is None for mm in rows_mm):
        return {}
    if not is_vision_language(getattr(model, "config", None)):
        raise UserError(
            "a prompt carries images (multi_modal_inputs) but the model is a text model; use a "
            "vision-language model (Qwen2-VL / Qwen2.5-VL) or drop the images from the data"
        )
    present = [mm for mm in rows_mm if mm is not None]
    return {
        "pixel_values": torch.cat([torch.as_tensor(mm["pixel_values"]) for mm in present]),  # (P, D)
        "image_grid_thw": torch.cat([torch.as_tensor(mm["image_grid_thw"]) for mm in present]),  # (I, 3)
        "mm_token_type_ids": (ids == model.config.image_token_id).int(),  # (B, T)
    }


@torch.no_grad()
def _generate_batch(
    model: nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int,
    device: torch.device,
    mm_inputs: list[dict[str, torch.Tensor] | None] | None = None,
) -> list[list]:
    """One HF ``generate`` call over ``prompts`` (left-padded), ``params.n`` outputs each; ``mm_inputs``: each
    prompt's images (a vision-language model) or None."""
    width = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(params.n)]  # interleaved [a, a, b, b]; greedy allows no n > 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B * n, T) left-padded
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    rows_mm = [mm for mm in (mm_inputs or [None] * len(prompts)) for _ in range(params.n)]
    images = {k: v.to(device) for k, v in image_kwargs(model, ids, rows_mm).items()}
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), **images, **_generate_kwargs(params, pad_id)
    )
    new = out.sequences[:, width:]  # (B * n, W)
    scores = torch.stack(out.scores, dim=1).float()  # (B * n, W, V) processed logits
    logps = torch.log_softmax(scores, dim=-1).gather(-1, new[..., None]).squeeze(-1)  # (B * n, W)
    eos, stop = set(params.eos_token_ids), set(params.stop_token_ids)
    results = []
    for i in range(len(prompts)):
        row = []
        for s in range(params.n):
            toks, lps = new[i * params.n + s].tolist(), logps[i * params.n + s].tolist()
            reason = "length"
            for k, t in enumerate(toks):
                if (t in eos and not params.ignore_eos) or t in stop:
                    reason = "eos" if t in eos and not params.ignore_eos else "stop"
                    toks, lps = toks[: k + 1], lps[: k + 1]
                    break
            row.append(GenerationOutput(toks, lps, reason))
        results.append(row)
    return results


def hf_generate(
    model: nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int = 0,
    max_model_len: int | None = None,
    mm_inputs: list[dict[str, torch.Tensor] | None] | None = None,
) -> list[list]:
    """``params.n`` responses per prompt with HF ``generate``; same output type as the engine. ``mm_inputs``:
    per prompt, its images (pixel_values, image_grid_thw) for a vision-language model, or None.

    Each response stops where its prompt plus response reaches the model's position limit (or
    ``max_model_len``), as in the built-in engine: prompts are grouped by that cap, one ``generate`` call
    per group (one call when no prompt is near the limit), so no position past the limit is ever used.
    """
    device = next(model.parameters()).device
    caps = response_caps(prompts, params.max_new_tokens, position_limit(model, max_model_len))
    results: list[list | None] = [None] * len(prompts)
    with _private_rng(params.seed, device):
        for cap in sorted(set(caps), reverse=True):
            idx = [i for i, c in enumerate(caps) if c == cap]
            group = dataclasses.replace(params, max_new_tokens=cap)
            mms = None if mm_inputs is None else [mm_inputs[i] for i in idx]
            rows = _generate_batch(model, [prompts[i] for i in idx], group, pad_id, device, mms)
            for i, row in zip(idx, rows):
                results[i] = row
    return results


class HFRollout:
    """The built-in engine's ``generate`` interface over transformers' ``generate`` (``rollout.engine=hf``, or
    a fallback).

    ``max_model_len`` caps prompt + response as the built-in engine does (each response stops at the model's
    position limit, or at this length when smaller).
    """

    def __init__(self, model: nn.Module, pad_token_id: int = 0, max_model_len: int | None = None) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        progress: Callable[[int], None] | None = None,
        mm_inputs: list[dict[str, torch.Tensor] | None] | None = None,
    ) -> list[list[GenerationOutput]]:
        """``params.n`` responses for each prompt through HF ``generate`` (``mm_inputs``: each one's images)."""
        out = hf_generate(self.model, prompts, params, self.pad_token_id, self.max_model_len, mm_inputs)
        if progress is not None:
            progress(len(prompts) * params.n)
        return out
