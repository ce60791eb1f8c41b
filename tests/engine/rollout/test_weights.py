"""Joining a projection group in place: values kept, the module's parameters become views of one buffer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.engine.rollout.weights import join_in_place
from hybridflow.models import build_tiny_model


def test_join_keeps_values_and_parameters_and_is_idempotent() -> None:
    mods = [nn.Linear(8, n) for n in (8, 4, 4)]
    params = [m.weight for m in mods]
    before = [p.detach().clone() for p in params]
    joined = join_in_place(params, cuda_only=False)
    assert joined is not None and joined.shape == (16, 8)
    for m, p, want, start in zip(mods, params, before, (0, 8, 12)):
        assert m.weight is p  # the same Parameter object (optimizers and hooks keep working)
        torch.testing.assert_close(p.detach(), want)
        assert p.data_ptr() == joined[start].data_ptr()  # a view of the joined rows
    again = join_in_place(params, cuda_only=False)
    assert again.data_ptr() == joined.data_ptr()  # already adjacent: no second copy
    with torch.no_grad():
        params[1].add_(1.0)  # a training step on the module is seen through the joined buffer
    torch.testing.assert_close(joined[8:12], before[1] + 1.0)


def test_join_refuses_mixed_groups_and_cpu_by_default() -> None:
    a, b = nn.Linear(8, 4).weight, nn.Linear(6, 4).weight
    assert join_in_place([a, b], cuda_only=False) is None  # different trailing shapes
    assert join_in_place([a, nn.Linear(8, 4).weight]) is None  # CPU: left as it is


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_model_on_gpu_gets_one_gemm_per_group_without_copies() -> None:
    model = build_tiny_model("qwen2", vocab_size=128, hidden_size=64, num_hidden_layers=2, seed=0)
    model = model.to("cuda", torch.bfloat16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    runner = LlamaRunner(model)
    layer, attn = runner.layers[0], model.model.layers[0].self_attn
    assert len(layer.qkv) == 1 and len(layer.gate_up) == 1
    assert attn.q_proj.weight.data_ptr() == layer.qkv[0].data_ptr()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
