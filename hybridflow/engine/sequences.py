"""Token-id prompts and responses into verl's training layout (left-padded prompt, right-padded response)."""

from __future__ import annotations

import torch

from hybridflow.protocol import Batch


def pack_prompt_response(
    prompts: list[list[int]], responses: list[list[int]], response_length: int, pad_token_id: int
) -> Batch:
    """A Batch with ``input_ids`` (B, P + R), ``attention_mask``, ``position_ids``, ``responses``, ``response_mask``.

    Prompts are left-padded to the longest prompt P, responses right-padded to ``response_length`` R (longer
    responses are refused: the rollout already caps them). Position ids count real tokens from 0.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    P = max((len(p) for p in prompts), default=0)
    R = response_length
    B = len(prompts)
    ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)  # (B, P + R)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        if len(r) > R:
            raise ValueError(f"response {b} has {len(r)} tokens, more than the response length {R}")
        ids[b, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        ids[b, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, P - len(p) : P + len(r)] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P + R)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            "responses": ids[:, P:].clone(),
            "response_mask": mask[:, P:].float(),
        }
    )
