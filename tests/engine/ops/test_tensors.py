"""Tensors as a rank holds them: local shards, and memory freed and allocated again in place."""

from __future__ import annotations

import torch

from hybridflow.engine.ops.tensors import Storages, local_shard


def test_storages_free_and_restore_in_place_keeping_views_and_counting_a_shared_storage_once() -> None:
    weight = torch.arange(12.0).reshape(3, 4)
    view = weight[1:]  # a binding's view of the same storage
    tied = weight  # the same tensor twice (a tied head)
    bias = torch.ones(5, dtype=torch.float16)
    storages = Storages([weight, tied, bias])
    assert storages.released_bytes() == 0
    assert storages.release() == 12 * 4 + 5 * 2
    assert weight.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    assert storages.released_bytes() == 12 * 4 + 5 * 2
    assert storages.release() == 0  # released already
    storages.restore()
    assert storages.released_bytes() == 0
    weight.copy_(torch.full((3, 4), 7.0))
    assert view.shape == (2, 4) and bool((view == 7).all())  # the view sees the restored storage
    assert bias.untyped_storage().nbytes() == 10


def test_local_shard_is_the_tensor_itself_detached() -> None:
    param = torch.nn.Parameter(torch.randn(4, 3))
    local = local_shard(param)
    assert not local.requires_grad and local.data_ptr() == param.data_ptr()
