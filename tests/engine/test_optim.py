import math

import pytest
import torch

from hybridflow.engine.optim import build_lr_scheduler, build_optimizer, lr_multiplier


def test_constant_with_warmup() -> None:
    assert [lr_multiplier(s, "constant", 4, 100) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_with_warmup_and_floor() -> None:
    # warmup 2, then cosine over 10 steps down to 0.1.
    assert lr_multiplier(1, "cosine", 2, 12, 0.1) == 0.5
    assert lr_multiplier(2, "cosine", 2, 12, 0.1) == pytest.approx(1.0)
    assert lr_multiplier(7, "cosine", 2, 12, 0.1) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))
    )
    assert lr_multiplier(12, "cosine", 2, 12, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(50, "cosine", 2, 12, 0.1) == pytest.approx(0.1)


def test_scheduler_drives_the_optimizer() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer([p], lr=1e-2)
    sched = build_lr_scheduler(opt, "cosine", warmup_steps=1, total_steps=3)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 1e-2, 5e-3, 0.0], abs=1e-12)


def test_bad_schedule_and_no_params() -> None:
    p = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match="unknown lr schedule 'linear'"):
        build_lr_scheduler(build_optimizer([p], lr=1.0), "linear")
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([torch.nn.Parameter(torch.ones(1), requires_grad=False)], lr=1.0)
