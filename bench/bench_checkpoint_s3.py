"""A checkpoint saved to object storage against the same save to the local disk, synchronous and
asynchronous: the training's stall, and the write behind it.

    python -m bench.bench_checkpoint_s3                      # about 2 minutes
    python -m bench.bench_checkpoint_s3 --models small --saves 2       # smoke run

The store is ``rclone serve s3`` on loopback over a directory on /tmp's disk (the tests' own
server, tests/harness/object_store.py), so a save to it costs what the S3 protocol costs (HTTP,
signing, multipart parts, the server writing files) over what a local save costs, with no
network in between. Each model (as bench/bench_async_checkpoint.py: ``small``, 71 MiB of
checkpoint, and ``wide``, 595 MiB) takes one AdamW step, then ``--saves`` saves each way, one
process in a gloo group of one, as the trainer runs it:

- synchronous: the ``CheckpointManager.save`` call (state dict, write, marker);
- asynchronous: what the loop waits for, the ``save`` call (the copy into host buffers) plus the
  finalize once the background write is done; the background write itself is printed apart.

Medians. Baseline: the local disk. Target: the asynchronous stall in object storage <= 1.5x the
local one's. The asynchronous copy stays in host memory until written: the write streams from
there to the bucket in multipart parts, so no node-local scratch copy is needed to keep the
stall short (the figures say what the write behind it costs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.bench_async_checkpoint import MODELS, trained_objects
from contract.run_dir import CHECKPOINT_LOCATION_FILE
from tests.harness.object_store import object_store
from train.checkpoint.location import prefix_for
from train.checkpoint.manager import CheckpointManager
from train.loop.garbage import pause as pause_collector

BUCKET = "bench"
TARGET = 1.5


def manager_at(run_dir: Path, bucket: bool, async_save: bool) -> CheckpointManager:
    """A manager of ``run_dir``'s checkpoints, in the bucket (as ``checkpoint.location``
    records it) or on its disk."""
    run_dir.mkdir(parents=True)
    if bucket:
        prefix = prefix_for(f"s3://{BUCKET}/runs", run_dir)
        (run_dir / CHECKPOINT_LOCATION_FILE).write_text(prefix + "\n")
    return CheckpointManager(run_dir, keep=1, async_save=async_save)


def timed_saves(
    manager: CheckpointManager, objects: tuple, saves: int
) -> list[tuple[float, float]]:
    """(stall, background write) of each save; a synchronous save's write is its stall."""
    times = []
    for step in range(1, saves + 1):
        started = time.perf_counter()
        manager.save(step, *objects, {"step": step})
        returned = time.perf_counter()
        pending = manager._pending
        if pending is None:
            times.append((returned - started, returned - started))
            continue
        while not pending.future.done():  # waited on here, to time the write apart
            time.sleep(0.001)
        written = time.perf_counter()
        manager.poll()
        times.append((returned - started + time.perf_counter() - written, written - returned))
    manager.finish()
    return times


def bench(name: str, saves: int, root: Path) -> None:
    objects = trained_objects(name)
    params = sum(p.numel() for p in objects[0].parameters())
    print(f"{name}: {params / 1e6:.1f} M parameters", flush=True)
    figures: dict[tuple[str, str], tuple[float, float]] = {}
    for where in ("disk", "bucket"):
        for how in ("sync", "async"):
            run_dir = root / f"{name}-{where}-{how}"
            manager = manager_at(run_dir, where == "bucket", how == "async")
            timed_saves(manager, objects, 1)  # warm-up: buffers, connections, plans
            times = timed_saves(manager, objects, saves)
            figures[where, how] = tuple(statistics.median(t) for t in zip(*times, strict=True))
    print(f"  {'':8} {'sync save s':>12} {'async stall s':>14} {'async write s':>14}")
    for where in ("disk", "bucket"):
        sync, (stall, write) = figures[where, "sync"][0], figures[where, "async"]
        print(f"  {where:8} {sync:12.3f} {stall:14.3f} {write:14.3f}")
    ratio = figures["bucket", "async"][0] / figures["disk", "async"][0]
    sync_ratio = figures["bucket", "sync"][0] / figures["disk", "sync"][0]
    print(
        f"  bucket / disk: async stall {ratio:.2f}x (target <= {TARGET}x), synchronous save "
        f"{sync_ratio:.2f}x",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pause_collector()  # as the trainer runs: no automatic collection inside a save
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        with object_store(root / "store", (BUCKET,)) as store:
            os.environ.update(store.env())
            for name in args.models:
                bench(name, args.saves, root / "runs")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
