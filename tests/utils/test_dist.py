"""``init_distributed`` after the default process group was destroyed in the same process: torch hands out the
group names again, and no DTensor result cached under the old group (its mesh) may be served under the new."""

from __future__ import annotations

from support.dist_util import run_world_kept

from hybridflow.utils.dist import free_port


def grad_groups_of_two_runs(rank: int, second_port: int) -> list[list[list[int]]]:
    """Two runs in one process, the first with more process groups (as an expert exchange makes) before its
    mesh: per run, the ranks of each group a gradient's mesh names."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hybridflow.utils.dist import init_distributed

    seen = []
    for extra in (3, 0):
        init_distributed()
        for _ in range(extra):
            dist.new_group([0, 1])
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "one"))  # "one": a group per rank
        w = torch.nn.Parameter(distribute_tensor(torch.arange(8.0).view(2, 4), mesh, [Shard(0), Shard(1)]))
        (w * w).sum().backward()  # the gradient's spec comes from torch's sharding-propagation cache
        seen.append([dist.get_process_group_ranks(w.grad.device_mesh.get_group(i)) for i in range(2)])
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(second_port)  # the first run's store may still hold its port
    return seen


def test_a_default_group_made_again_serves_no_spec_of_the_last_ones_meshes() -> None:
    # Before: the second run's gradient named the first run's groups "4" and "5" (3 groups later than its own
    # "1" and "2"): "Could not resolve the process group registered under the name 5", or another group.
    for rank, runs in enumerate(run_world_kept(2, grad_groups_of_two_runs, free_port())):
        assert runs == [[[0, 1], [rank]]] * 2, rank
