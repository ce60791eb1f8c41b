"""Generation through transformers' ``generate`` for architectures the built-in engine does not cover.

Also what ``rollout.engine=hf`` selects, for comparison. The outputs have the same form as the built-in
engine's; log-probs come from the processed scores (after temperature and top-k/top-p/min-p), i.e. the
distribution actually sampled from, as in ``sampling.sample``.

RNG: HF ``generate`` samples from torch's global RNG and takes no generator. A seeded call therefore forks
the global state of the CPU and of the model's device, seeds the fork and restores the state afterwards, so
the training RNG is exactly as it was (DESIGN.md section 4). Forking, rather than re-implementing HF's
sampling with a private generator, keeps this path HF's own sampler, which is what it is compared for. An
unseeded call draws from the global RNG, as the built-in engine does with ``seed=None``. The fork swaps
process-wide state: another thread drawing from the global RNG during a seeded rollout would draw from the
seeded stream and lose its draws (the trainer's only other thread, the async reward, ends with its step).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from hybridflow.engine.rollout.sampling import SamplingParams

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


@torch.no_grad()
def hf_generate(
    model: nn.Module, prompts: list[list[int]], params: SamplingParams, pad_id: int = 0
) -> list[list]:
    """``params.n`` responses per prompt with HF ``generate`` (left-padded batch); same output type as the engine."""
    from hybridflow.engine.rollout.engine import GenerationOutput

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(params.n)]  # interleaved [a, a, b, b]; greedy allows no n > 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B * n, T) left-padded
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with _private_rng(params.seed, device):
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), **_generate_kwargs(params, pad_id)
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
