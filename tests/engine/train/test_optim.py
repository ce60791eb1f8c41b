import math

import pytest
import torch
from support.dist_util import run_world_kept as run_world

from hybridflow.engine.train.optim import allocate_state, build_lr_scheduler, build_optimizer, lr_multiplier


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


def _three_steps(eager: bool, weight_decay: float) -> tuple[list[torch.Tensor], dict]:
    """Three AdamW steps (with a schedule) on a small net; ``eager`` allocates the state first."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = build_optimizer(net.parameters(), lr=1e-2, weight_decay=weight_decay)
    sched = build_lr_scheduler(opt, "cosine", warmup_steps=1, total_steps=4)
    if eager:
        before = [p.detach().clone() for p in net.parameters()]
        allocate_state(opt)
        assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))  # lr 0: nothing moved
        assert all(p.grad is None for p in net.parameters())
        assert opt.param_groups[0]["lr"] == 0.0 and sched.get_last_lr() == [0.0]  # warm-up's first lr
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        net(x).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in net.parameters()], opt.state_dict()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_allocated_state_leaves_training_bit_identical(weight_decay: float) -> None:
    lazy_params, lazy_state = _three_steps(False, weight_decay)
    eager_params, eager_state = _three_steps(True, weight_decay)
    assert all(torch.equal(a, b) for a, b in zip(lazy_params, eager_params))
    for key, lazy in lazy_state["state"].items():
        for name, value in lazy.items():
            assert torch.equal(eager_state["state"][key][name], value), (key, name)


def test_allocate_state_creates_zero_moments_at_step_zero() -> None:
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = build_optimizer([p], lr=1e-3)
    allocate_state(opt)
    state = opt.state[p]
    assert float(state["step"]) == 0.0
    assert state["exp_avg"].shape == p.shape and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    moments = state["exp_avg"]
    allocate_state(opt)  # already there: untouched
    assert opt.state[p]["exp_avg"] is moments


def _steps_of(opt: torch.optim.Optimizer, param: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
    return param.detach().clone()


def test_host_parameters_get_the_foreach_adamw() -> None:
    opt = build_optimizer([torch.nn.Parameter(torch.ones(3))], lr=1e-3)
    assert opt.defaults["foreach"] and not opt.defaults["fused"]


@pytest.mark.gpu
def test_cuda_parameters_get_the_fused_adamw_with_foreach_values() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    start = torch.randn(4096, device="cuda", generator=g)
    grads = [torch.randn(4096, device="cuda", generator=g) for _ in range(3)]
    fused_p, foreach_p = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    fused = build_optimizer([fused_p], lr=1e-3)
    assert fused.defaults["fused"]
    foreach = torch.optim.AdamW([foreach_p], lr=1e-3, weight_decay=0.01, foreach=True)
    a, b = _steps_of(fused, fused_p, grads), _steps_of(foreach, foreach_p, grads)
    assert not torch.equal(a, start)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # the same update up to float32 rounding


def test_cosine_cycles_shape_the_schedule() -> None:
    opt = build_optimizer([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    sched = build_lr_scheduler(opt, "cosine", warmup_steps=0, total_steps=4, num_cycles=1.0)
    lrs = []
    for _ in range(5):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0, 0.5, 0.0, 0.5, 1.0], abs=1e-6)  # one whole cycle: down and back up


def engine_lrs(rank: int, num_cycles: float) -> list[float]:
    """The learning rates a CPU TrainEngine steps through with ``optim.num_cycles`` from the config."""
    from hybridflow.config.schema import FSDPConfig, OptimConfig
    from hybridflow.engine.parallel.parallelize import parallelize
    from hybridflow.engine.train.train_engine import TrainEngine

    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optim = OptimConfig(lr=1.0, lr_scheduler_type="cosine", num_cycles=num_cycles)
    parallel = parallelize(net, None, FSDPConfig(), trainable=True, compile=False, layers=[])
    engine = TrainEngine(parallel, FSDPConfig(), optim, total_steps=4)
    lrs = []
    for _ in range(3):
        lrs.append(engine.lr)
        engine.lr_step()
    return lrs


def test_the_engine_takes_num_cycles_from_the_config() -> None:
    (half,) = run_world(1, engine_lrs, 0.5)
    (whole,) = run_world(1, engine_lrs, 1.0)
    assert half == pytest.approx([1.0, 0.8535534, 0.5], abs=1e-6)  # the default half-cosine
    assert whole == pytest.approx([1.0, 0.5, 0.0], abs=1e-6)
