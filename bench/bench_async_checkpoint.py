"""How long an asynchronous checkpoint stalls training, against a synchronous save of the same
state, on CPU (one process in a gloo group of one, as the trainer runs it).

    python -m bench.bench_async_checkpoint                     # about 2 minutes
    python -m bench.bench_async_checkpoint --models small --saves 2      # smoke run

Each model takes one AdamW step (so the optimizer state exists), then is saved ``--saves``
times each way into a fresh run dir under ``--dir`` (default: a temporary dir on the disk of
/tmp; files are fsynced, so the disk's speed counts):

- synchronous: the time of ``CheckpointManager.save`` (the whole write, marker and rename);
- asynchronous (``checkpoint.async_save``): the stall is what the loop waits for: the ``save``
  call (state dict, copy into the reused CPU buffers) plus the finalize (marker and rename) once
  the background write (non-finite check, RNG file, DCP's files) is done, timed apart from that
  write. The background write's own duration is printed too.

Each figure is the median over the saves. Target: async stall / sync save <= 10%. Models: the
``small`` preset (6 M parameters, 71 MiB of checkpoint) and ``wide``, the same model at
d_model 1024 (52 M parameters, 595 MiB): the stall is mostly the copy, a memory-bandwidth cost
that grows with the state like the synchronous save does, plus a fixed cost (the state dict,
the finalize's fsyncs) that a wider model amortizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from train.checkpoint.manager import CheckpointManager
from train.models.build import build_model
from train.models.presets import get_preset

MODELS = {
    "small": get_preset("small"),
    "wide": dataclasses.replace(get_preset("small"), d_model=1024, ffn_hidden=2816),
}


def trained_objects(model_name: str):
    """The model after one AdamW step on random gradients, its optimizer and schedule."""
    model = build_model(MODELS[model_name], torch.device("cpu"), init_seed=1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def state_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def sync_saves(root: Path, objects: tuple, saves: int) -> tuple[list[float], int]:
    manager = CheckpointManager(root / "sync", keep=1)
    times = []
    for step in range(1, saves + 1):
        started = time.perf_counter()
        path = manager.save(step, *objects, {"step": step})
        times.append(time.perf_counter() - started)
    manager.finish()
    return times, state_bytes(path)


def async_saves(root: Path, objects: tuple, saves: int) -> tuple[list[float], list[float]]:
    """The stalls (save call + finalize) and the background writes' durations."""
    manager = CheckpointManager(root / "async", keep=1, async_save=True)
    stalls, writes = [], []
    for step in range(1, saves + 1):
        started = time.perf_counter()
        manager.save(step, *objects, {"step": step})
        returned = time.perf_counter()
        future = manager._pending.future  # waited on here, to time the write apart
        while not future.done():
            time.sleep(0.001)
        written = time.perf_counter()
        manager.poll()
        stalls.append(returned - started + time.perf_counter() - written)
        writes.append(written - returned)
    manager.finish()
    return stalls, writes


def bench(name: str, saves: int, directory: Path | None) -> None:
    objects = trained_objects(name)
    params = sum(p.numel() for p in objects[0].parameters())
    with tempfile.TemporaryDirectory(dir=directory) as root:
        sync_saves(Path(root) / "warmup", objects, 1)
        sync_times, nbytes = sync_saves(Path(root), objects, saves)
        stalls, writes = async_saves(Path(root), objects, saves)
    sync_s, stall_s = statistics.median(sync_times), statistics.median(stalls)
    print(f"{name}: {params / 1e6:.1f} M parameters, checkpoint {nbytes / 2**20:.1f} MiB")
    print(f"  synchronous save:              {sync_s * 1e3:8.1f} ms (median of {saves})")
    print(f"  asynchronous: training stalls  {stall_s * 1e3:8.1f} ms")
    print(f"                background write {statistics.median(writes) * 1e3:8.1f} ms")
    print(f"  stall / synchronous save: {stall_s / sync_s:.1%} (target <= 10%)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for name in args.models:
        bench(name, args.saves, args.dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
