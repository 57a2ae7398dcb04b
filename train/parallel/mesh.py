"""Builds the DeviceMesh views that `ParallelDims` describes; the only place with mesh calls.

One 1-D world mesh is unflattened into the dense view (pp, dp_replicate, dp_shard, cp, tp), the
sparse view (pp, dp_replicate, efsdp, ep), and under CP two more views of the same ranks:
(pp, dp_replicate, dp_shard_cp, tp), whose dp_shard_cp is what FSDP spans, and
(pp, dp_replicate, dp_shard, cp_tp), whose cp_tp holds the shards of one sequence. All share the
world as root mesh, which FSDP needs to combine its sharding with the TP/EP placements of a
parameter.

torch creates each view's subgroups with its own default timeout (30 min for gloo, 10 for NCCL),
not the default group's, so `build_meshes` gives them the job's. The views are unflattened by dim
index, never by name: torch 2.11's ``_unflatten`` rejects a dim given by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train.compat import set_group_timeout
from train.parallel.dims import DENSE_DIMS, DP_VIEW, SPARSE_DIMS, ParallelDims

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Meshes:
    """The views a training job uses, each a DeviceMesh over the same world."""

    dims: ParallelDims
    dense: DeviceMesh
    sparse: DeviceMesh
    dp: DeviceMesh
    fsdp_view: DeviceMesh  # the dense view, or under CP the one with dp_shard_cp
    sequence_view: DeviceMesh | None  # under CP and TP: the view with cp_tp

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
    def cp(self) -> DeviceMesh:
        return self.dense["cp"]

    @property
    def sequence(self) -> DeviceMesh | None:
        """The ranks that each hold part of one sequence (cp x tp), or None if none do."""
        dims = self.dims
        if self.sequence_view is not None:
            return self.sequence_view["cp_tp"]
        if dims.cp_enabled:
            return self.cp
        return self.tp if dims.tp_enabled else None

    @property
    def fsdp(self) -> DeviceMesh:
        """Mesh for `fully_shard` of dense modules (2-D, i.e. HSDP, when replicas exist)."""
        return self.fsdp_view[self.dims.fsdp_dims]

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """Mesh for `fully_shard` of the MoE experts."""
        return self.sparse[self.dims.expert_fsdp_dims]

    def subgroups(self) -> list[dist.ProcessGroup]:
        """This rank's process group of every dim of every view, once each, but the default
        group (what a dim spanning the whole world uses). Slices such as `fsdp` and `tp` use
        these same groups."""
        views = (self.dense, self.sparse, self.dp, self.fsdp_view, self.sequence_view)
        world = dist.group.WORLD.group_name
        groups = {
            group.group_name: group
            for view in views
            if view is not None
            for group in view.get_all_groups()
        }
        return [group for name, group in groups.items() if name != world]


def build_meshes(dims: ParallelDims, device_type: str, timeout: timedelta | None = None) -> Meshes:
    """Create every view; call once per process, after the default process group exists.
    ``timeout``: that of the default group (``watchdog.process_group_timeout``), given to every
    subgroup of the views; None leaves them torch's default."""
    if dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"the layout is for {dims.world_size} ranks but the process group has "
            f"{dist.get_world_size()}"
        )
    world = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("world",))
    dense = world._unflatten(0, dims.dense_shape, DENSE_DIMS)
    sparse = world._unflatten(0, dims.sparse_shape, SPARSE_DIMS)
    dp = dense["dp_replicate", "dp_shard"]._flatten(DP_VIEW)
    fsdp_view, sequence_view = dense, None
    if dims.cp_enabled:
        pp, replicas, shards, cp, tp = dims.dense_shape
        fsdp_view = world._unflatten(
            0, (pp, replicas, shards * cp, tp), ("pp", "dp_replicate", "dp_shard_cp", "tp")
        )
        if dims.tp_enabled:
            sequence_view = world._unflatten(
                0, (pp, replicas, shards, cp * tp), ("pp", "dp_replicate", "dp_shard", "cp_tp")
            )
    meshes = Meshes(
        dims=dims,
        dense=dense,
        sparse=sparse,
        dp=dp,
        fsdp_view=fsdp_view,
        sequence_view=sequence_view,
    )
    if timeout is not None:
        for group in meshes.subgroups():
            set_group_timeout(group, timeout)
    if dist.get_rank() == 0:
        log.info("parallel layout: %s on %s", dims.describe(), device_type)
    return meshes
