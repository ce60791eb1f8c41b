"""zero_state puts a stepped optimizer's state back to what a never-stepped one would allocate."""

from __future__ import annotations

import torch

from hybridflow.utils.optim_state import zero_state


def test_zero_state_matches_the_state_of_a_first_step() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=0.1, amsgrad=True)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    state = opt.state[p]
    assert float(state["step"]) == 3 and state["exp_avg"].abs().sum() > 0
    zero_state(opt)
    assert float(state["step"]) == 0
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert torch.count_nonzero(state[key]) == 0, key
    # a plain int step (optimizers that keep one) is reset too
    state["step"] = 7
    zero_state(opt)
    assert state["step"] == 0
