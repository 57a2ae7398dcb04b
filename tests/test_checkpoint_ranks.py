"""Asynchronous checkpoints across two FSDP2 ranks, spawned from this module (gloo, CPU).

The in-process asynchronous tests are in tests/test_checkpoint.py; this module stays light, as
each spawned rank imports it.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from train.checkpoint.manager import CheckpointManager, NonFiniteState


def _train_step(model, optimizer, scheduler) -> None:
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _sharded_objects(seed: int):
    """A small model sharded by FSDP2 over the process group, after one AdamW step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _train_step(model, optimizer, scheduler)
    return model, optimizer, scheduler


def _local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


def _rank_main(rank: int, store: str, run_dir: Path) -> None:
    """One of the two ranks: an async save that completes and reloads shard for shard, then one
    that rank 1 alone makes non-finite; each rank writes the error it got to a file."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    written: list[str] = []
    save = dcp.save

    def counted(state_dict, **kwargs):
        written.append(str(kwargs["storage_writer"].path))
        return save(state_dict, **kwargs)

    dcp.save = counted  # this process ends with the test
    manager = CheckpointManager(run_dir, keep=1, async_save=True)
    model, optimizer, scheduler = _sharded_objects(seed=1)
    want = _local_params(model)
    path = manager.save(1, model, optimizer, scheduler, {"step": 1})
    _train_step(model, optimizer, scheduler)  # in place, while the files are written
    manager.wait()
    fresh, fresh_optimizer, _ = _sharded_objects(seed=2)
    manager.load(path, fresh, fresh_optimizer, None)
    assert all(isinstance(p, DTensor) for p in fresh.parameters())
    for name, param in _local_params(fresh).items():
        assert torch.equal(param, want[name]), name
    if rank == 1:
        model[0].weight.to_local().data[0, 0] = float("nan")
    manager.save(2, model, optimizer, scheduler, {"step": 2})
    try:
        manager.wait()
    except NonFiniteState as error:
        (run_dir / f"rank{rank}.refused").write_text(str(error))
    assert len(written) == 1, f"rank {rank} wrote {written}"
    dist.destroy_process_group()


def test_two_ranks_refuse_an_async_save_that_one_of_them_holds_non_finite(tmp_path):
    """Sharded states survive the staging (DTensors reload shard for shard). Then rank 1's
    shard alone is not finite: neither rank writes (they agree before DCP's collectives, or
    rank 0 would wait for rank 1 in them), both raise the same error naming rank 1, and step_1
    stays the checkpoint."""
    run_dir = tmp_path / "run"
    context = mp.start_processes(
        _rank_main, args=(str(tmp_path / "store"), run_dir), nprocs=2, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + 240
    try:
        while not context.join(timeout=1):  # True once both ranks are done; raises if one fails
            assert time.monotonic() < deadline, "the ranks did not finish in 240 s"
    finally:
        for process in context.processes:
            process.kill()
    errors = [(run_dir / f"rank{rank}.refused").read_text() for rank in (0, 1)]
    assert errors[0] == errors[1], errors
    assert re.fullmatch(
        r"not saving checkpoint step_2: model\.0\.weight \(rank 1\) holds non-finite values "
        r"\(NaN or inf\); the last good checkpoint step_1 is kept",
        errors[0],
    ), errors[0]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_1"]
