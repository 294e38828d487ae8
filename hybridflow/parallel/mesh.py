"""Device meshes of the training layouts, in the rank order of ``hybridflow.parallel.layout``."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridflow.device import device_type
from hybridflow.parallel.layout import ParallelLayout


def world_size() -> int:
    """Ranks in the default group (1 when torch.distributed is not initialised: a plain process)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def build_training_mesh(layout: ParallelLayout) -> DeviceMesh | None:
    """The ("dp", "pp", "tp") mesh of ``layout`` over the default group; None for a single process."""
    if layout.world_size != world_size():
        raise ValueError(f"layout needs {layout.world_size} ranks, the process group has {world_size()}")
    if layout.world_size == 1:
        return None
    return init_device_mesh(device_type(), (layout.dp_size, layout.pp_size, layout.tp_size),
                            mesh_dim_names=("dp", "pp", "tp"))


def mesh_group(mesh: DeviceMesh | None, dim: str):
    """The process group of one mesh dimension, or None when there is no mesh."""
    return None if mesh is None else mesh.get_group(dim)


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank_to_global(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
