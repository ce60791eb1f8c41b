"""The switch delivering FP8 projections (``rollout.quantization=fp8``) on gloo processes.

Two ranks holding FSDP2 shards (each row on one rank) fill their generation shards, a whole replica (tp = 1)
or a tensor-parallel half (tp = 2): every FP8 weight and its rows' scales equal the full weight quantised,
then sliced, bit for bit (column- and row-parallel projections, KV heads), every other tensor is the full
weight's slice as before, the bytes on the wire shrink and are counted as they are (FP8 elements and
their scales, in the switch line too), and a second switch after a "training step" lands in
the same tensors. The runner on the FP8 replica scores close to the full-precision model, not equal to it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.dist_util import run_world_kept
from support.row_cache import RowCache

from hybridflow.engine.ops.fp8 import quantise_rows
from hybridflow.engine.parallel.layout import layouts
from hybridflow.models import build_tiny_model
from hybridflow.utils.errors import format_bytes


def _model(arch: str) -> torch.nn.Module:
    return build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=3)


def _plain(module: torch.nn.Module) -> dict:
    """The module's parameters, FP8 ones as their bytes (uint8: what crosses a process boundary)."""
    fp8 = torch.float8_e4m3fn
    return {
        n: (p.detach().view(torch.uint8) if p.dtype == fp8 else p.detach()).clone()
        for n, p in module.named_parameters()
    }


def switch(rank: int, arch: str, tp: int) -> dict:
    import torch.distributed as dist

    from hybridflow.engine.hybrid.plan import ReshardPlan
    from hybridflow.engine.hybrid.switch import RolloutShard
    from hybridflow.engine.parallel.fsdp import shard_model
    from hybridflow.engine.parallel.view import GenerateView
    from hybridflow.engine.rollout.model import LlamaRunner

    dist.init_process_group("gloo")
    lm = _model(arch)
    sharded = copy.deepcopy(lm)
    shard_model(sharded, list(sharded.model.layers), torch.device("cpu"))
    cpu = torch.device("cpu")
    weights = RolloutShard(sharded, GenerateView(2, tp), rank, torch.float32, cpu, 1 << 12, fp8=True)
    received = weights.sync(sharded)
    plan = weights.plan
    first = _plain(weights.module)
    fp8 = [n for n, p in weights.module.named_parameters() if p.dtype == torch.float8_e4m3fn]
    scales = {n: b.clone() for n, b in weights.module.named_buffers() if n.endswith("weight_scale")}
    ptrs = [p.data_ptr() for p in weights.module.parameters()]
    out = {
        "first": first,
        "fp8": fp8,
        "scales": scales,
        "received": received,
        "plan_bytes": weights.plan.bytes_received(rank),
        "float32_bytes": ReshardPlan(plan.params, plan.view, 4, 1 << 12, plan.holdings).bytes_received(rank),
        "scale_bytes": plan.scale_bytes_received(rank),
        "scale_rows": sum(b.numel() for b in scales.values()),  # this rank's rows (all of them at tp = 1)
        "line": weights.switch_line(),
        "generation_bytes": plan.generation_bytes(),
        "held_bytes": sum(p.numel() * p.element_size() for p in weights.module.parameters())
        + sum(b.numel() * 4 for b in scales.values()),
    }
    with torch.no_grad():
        for p in sharded.parameters():
            p.to_local().mul_(-0.5)
    weights.sync(sharded)
    out["second"] = _plain(weights.module)
    out["same_tensors"] = ptrs == [p.data_ptr() for p in weights.module.parameters()]
    if tp == 1:  # the runner on the FP8 replica against the full-precision model (its -0.5 weights)
        ids = torch.tensor([[3, 4, 5, 9, 11, 2]])
        runner = LlamaRunner(weights.module)
        out["logits"] = RowCache(runner, 1, 8).prefill(ids, torch.tensor([6]))
        with torch.no_grad():
            for p in lm.parameters():
                p.mul_(-0.5)
            out["want_logits"] = lm(ids).logits[:, -1]
    return out


def _expected(lm: torch.nn.Module, tp: int, t: int, scale: float, names: set[str]) -> tuple[dict, dict]:
    """Rank ``t``'s FP8 weights and scales: the full weights (times ``scale``) quantised, then sliced."""
    lays = layouts(lm, tp)
    data, scales = {}, {}
    for name, p in lm.named_parameters():
        if name not in names:
            continue
        q = quantise_rows(scale * p.detach())
        box = lays[name].box(t)
        rows, cols = slice(*box[0]), slice(*box[1])
        data[name], scales[name] = q.data[rows, cols], q.scale[rows]
    return data, scales


@pytest.mark.parametrize(("arch", "tp"), [("qwen2", 1), ("qwen3", 2), ("llama", 2)])
def test_fp8_shards_equal_the_full_weights_quantised_then_sliced(arch: str, tp: int) -> None:
    results = run_world_kept(2, switch, arch, tp)
    lm = _model(arch)
    full = dict(lm.named_parameters())
    for rank, out in enumerate(results):
        t = rank % tp
        fp8 = set(out["fp8"])
        assert any("o_proj" in n for n in fp8) and any("down_proj" in n for n in fp8)  # row-parallel ones
        assert not any("embed" in n or "norm" in n for n in fp8)
        for key, scale in (("first", 1.0), ("second", -0.5)):
            data, scales = _expected(lm, tp, t, scale, fp8)
            for n in fp8:
                assert torch.equal(out[key][n], data[n].view(torch.uint8)), (rank, key, n)
            if key == "first":
                for n in fp8:
                    assert torch.equal(out["scales"][n.removesuffix("weight") + "weight_scale"], scales[n]), n
        if tp == 1:  # a whole replica: every other tensor is the full one
            plain = [n for n in out["first"] if n not in fp8]
            assert all(torch.equal(out["first"][n], full[n].detach()) for n in plain)
        assert out["same_tensors"]
        # The switch's count is true: what the all-to-alls delivered (1 byte an FP8 element) and the scales (4
        # bytes a row of every FP8 weight, from the all-reduce) is what the plan and the switch line report.
        assert out["received"] == out["plan_bytes"] < out["float32_bytes"]
        assert out["scale_bytes"] > 0
        assert out["generation_bytes"] == out["held_bytes"]  # the shard's FP8 weights, scales, the rest
        if tp == 1:
            assert out["scale_bytes"] == 4 * out["scale_rows"]  # every row's scale of the whole replica
        assert out["line"].startswith(f"Stage switch: {format_bytes(out['plan_bytes'])} received per rank")
    if tp == 1:
        got, want = results[0]["logits"], results[0]["want_logits"]
        rel = (got - want).norm() / want.norm()
        assert 0 < rel < 0.1, rel
