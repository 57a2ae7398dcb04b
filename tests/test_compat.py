"""train/compat.py: each shim on both torch spellings, on CPU.

Only torch 2.13 is installed here, so the 2.11 spelling is simulated: the 2.13 attribute is
removed and, where 2.11 runs other code, that code is put in its place (2.11's
``all_gather_tensor_autograd`` calls an op that 2.13 still registers). The collectives run on real
gloo groups of forked ranks: forking keeps the parent's imports, a few seconds where spawning
four ranks that each import torch takes twenty on this machine. The floor itself (torch 2.11 on
CUDA) runs on the GPU machine (bench/gpu_check.sh), not here.
"""

from __future__ import annotations

import time
import tokenize
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import init_device_mesh

from tests.harness.process import REPO
from train import compat
from train.parallel.dims import ParallelDims
from train.parallel.mesh import build_meshes

SCANNED = [
    *(path for path in sorted((REPO / "train").rglob("*.py")) if path.name != "compat.py"),
    REPO / "bench" / "bench_fast_path.py",
]
# The torch names train/compat.py wraps: anywhere else, use its shim.
SHIMMED = {
    "all_gather_single_autograd": "use train.compat.all_gather_autograd",
    "all_gather_tensor_autograd": "use train.compat.all_gather_autograd",
    "_set_pg_timeout": "use train.compat.set_group_timeout",
}
# Names torch 2.13 has and 2.11 lacks, among the APIs train/ uses (the 2.11 vs 2.13 comparison
# of those APIs): a use needs a shim in train/compat.py first.
ONLY_IN_213 = (
    "all_gather_single",
    "reduce_scatter_single",
    "reduce_scatter_single_autograd",
    "grad_placements",  # DTensor.from_local
    "dp_mesh_dims",  # fully_shard
    "DataParallelMeshDims",
    "ShardPlacementResult",
    "defer_pp_recv",  # ScheduleInterleaved1F1B
    "isolate_recompiles",  # torch.compile
    "shapes_spec",
    "record_comm",
)
NOT_OUTSIDE_COMPAT = {
    **SHIMMED,
    **dict.fromkeys(ONLY_IN_213, "not in torch 2.11: add a shim to train/compat.py"),
    "DefaultStager": (
        "torch 2.11's stages once per instance (the next stage raises KeyError): stage as "
        "train/checkpoint/staging.py does, or add a shim to train/compat.py"
    ),
}
DEFAULT_TIMEOUT = timedelta(seconds=60)
SUBGROUP_TIMEOUT = timedelta(seconds=2)


def run_ranks(worker: Callable, world_size: int, tmp_path: Path) -> None:
    """``worker(rank, world_size, store_file)`` on ``world_size`` forked ranks; a failure on any
    rank fails the test with that rank's traceback."""
    assert not dist.is_initialized(), "a forked rank would inherit this process's group"
    store = str(tmp_path / "store")
    mp.start_processes(worker, args=(world_size, store), nprocs=world_size, start_method="fork")


def join(rank: int, world_size: int, store: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=DEFAULT_TIMEOUT,
    )


def all_gather_tensor_autograd_211(
    x: torch.Tensor, gather_dim: int, group, tag: str = ""
) -> torch.Tensor:
    """torch 2.11's ``all_gather_tensor_autograd`` for ``gather_dim`` 0: its autograd op, then
    the wait (2.11 defers it into an AsyncCollectiveTensor)."""
    assert gather_dim == 0
    group_name = funcol._resolve_group_name(group, tag)
    size = distributed_c10d._get_group_size_by_name(group_name)
    gathered = torch.ops._c10d_functional_autograd.all_gather_into_tensor(x, size, group_name)
    return funcol.wait_tensor(gathered)


def gather_and_backward(mesh, x: torch.Tensor, weights: torch.Tensor):
    leaf = x.clone().requires_grad_()
    gathered = compat.all_gather_autograd(leaf, mesh)
    (gathered * weights).sum().backward()
    return gathered.detach(), leaf.grad


def gather_worker(rank: int, world_size: int, store: str) -> None:
    join(rank, world_size, store)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    weights = torch.randn(3 * world_size, 4, generator=torch.Generator().manual_seed(99))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # 2.13's deprecated spelling warns
        new = gather_and_backward(mesh, xs[rank], weights)
    calls = []

    def spelt_as_in_211(*args, **kwargs):
        calls.append(args)
        return all_gather_tensor_autograd_211(*args, **kwargs)

    single, tensor = funcol.all_gather_single_autograd, funcol.all_gather_tensor_autograd
    del funcol.all_gather_single_autograd
    funcol.all_gather_tensor_autograd = spelt_as_in_211
    try:
        old = gather_and_backward(mesh, xs[rank], weights)
    finally:
        funcol.all_gather_single_autograd = single
        funcol.all_gather_tensor_autograd = tensor
    assert len(calls) == 1
    # Every rank's x in rank order; each rank's loss reaches x through every rank's copy.
    assert torch.equal(new[0], torch.cat(xs))
    assert torch.allclose(new[1], world_size * weights.chunk(world_size)[rank])
    assert torch.equal(old[0], new[0])
    assert torch.equal(old[1], new[1])
    dist.destroy_process_group()


def test_both_all_gather_spellings_give_the_same_values_and_gradients(tmp_path):
    run_ranks(gather_worker, 2, tmp_path)


def backend_timeout(group: dist.ProcessGroup) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def timeout_worker(rank: int, world_size: int, store: str) -> None:
    join(rank, world_size, store)
    meshes = build_meshes(ParallelDims(world_size=world_size, cp=2, tp=2), "cpu", SUBGROUP_TIMEOUT)
    groups = meshes.subgroups()
    # Every view makes groups of its own: the dense view's cp and tp and the FSDP view's
    # dp_shard_cp and tp hold two ranks, the other dims one; cp_tp and the sparse efsdp span the
    # world, so they are the default group, which keeps its own timeout.
    assert sorted(group.size() for group in groups if group.size() > 1) == [2, 2, 2, 2]
    assert all(backend_timeout(group) == SUBGROUP_TIMEOUT for group in groups)
    assert backend_timeout(dist.group.WORLD) == DEFAULT_TIMEOUT
    tp = meshes.tp.get_group()
    names = {group.group_name for group in groups}
    assert {tp.group_name, meshes.fsdp.get_group().group_name} <= names
    if rank == 0:  # its TP peer, rank 1, never joins: the all-reduce must give up
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out"):
            dist.all_reduce(torch.ones(1), group=tp)
        waited = time.monotonic() - started
        assert SUBGROUP_TIMEOUT.total_seconds() <= waited < 10 * SUBGROUP_TIMEOUT.total_seconds()
    dist.barrier()  # the others wait here (on the default group) for rank 0 to give up
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_mesh_subgroup_times_out_after_the_given_timeout(tmp_path):
    run_ranks(timeout_worker, 4, tmp_path)


def test_a_torch_without_set_pg_timeout_is_refused(monkeypatch):
    monkeypatch.delattr(distributed_c10d, "_set_pg_timeout")
    with pytest.raises(RuntimeError, match=r"_set_pg_timeout \(torch>=2\.11\)"):
        compat.set_group_timeout(None, SUBGROUP_TIMEOUT)  # refused before the group is used


def test_version_dependent_apis_are_reached_only_through_compat():
    found = []
    for path in SCANNED:
        with tokenize.open(path) as source:
            for token in tokenize.generate_tokens(source.readline):
                if token.type == tokenize.NAME and token.string in NOT_OUTSIDE_COMPAT:
                    where = f"{path.relative_to(REPO)}:{token.start[0]}"
                    found.append(f"{where}: {token.string}: {NOT_OUTSIDE_COMPAT[token.string]}")
    assert not found, "\n".join(found)
