"""Builds the DeviceMesh views that `ParallelDims` describes; the only place with mesh calls.

One 1-D world mesh is unflattened into the dense view (pp, dp_replicate, dp_shard, tp) and the
sparse view (pp, dp_replicate, efsdp, ep). Both share the world as root mesh, which FSDP needs to
combine its sharding with the TP/EP placements of a parameter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train.parallel_dims import DENSE_DIMS, DP_VIEW, SPARSE_DIMS, ParallelDims

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Meshes:
    """The views a training job uses, each a DeviceMesh over the same world."""

    dims: ParallelDims
    dense: DeviceMesh
    sparse: DeviceMesh
    dp: DeviceMesh

    @property
    def tp(self) -> DeviceMesh:
        return self.dense["tp"]

    @property
    def ep(self) -> DeviceMesh:
        return self.sparse["ep"]

    @property
    def pp(self) -> DeviceMesh:
        return self.dense["pp"]

    @property
    def fsdp(self) -> DeviceMesh:
        """Mesh for `fully_shard` of dense modules (2-D, i.e. HSDP, when replicas exist)."""
        return self.dense[self.dims.fsdp_dims]

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """Mesh for `fully_shard` of the MoE experts."""
        return self.sparse[self.dims.expert_fsdp_dims]


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """Create every view; call once per process, after the default process group exists."""
    if dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"the layout is for {dims.world_size} ranks but the process group has "
            f"{dist.get_world_size()}"
        )
    world = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("world",))
    dense = world._unflatten(0, dims.dense_shape, DENSE_DIMS)
    sparse = world._unflatten(0, dims.sparse_shape, SPARSE_DIMS)
    dp = dense["dp_replicate", "dp_shard"]._flatten(DP_VIEW)
    if dist.get_rank() == 0:
        log.info("parallel layout: %s on %s", dims.describe(), device_type)
    return Meshes(dims=dims, dense=dense, sparse=sparse, dp=dp)
