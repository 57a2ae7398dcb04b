"""Runs the trainer's own training steps on real corpus batches and counts the tensor values
read back to the host while they run.

    torchrun --standalone --nproc-per-node=2 tests/harness/workers/host_sync_worker.py \
        --corpus DIR --preset tiny_moe --ep 2 --out result.json

After one warm-up step, ``--steps`` calls of ``Trainer.train_step`` (forward, backward, gradient
clipping, the optimizer; no sync step) run under a dispatch mode that records every op that
turns a tensor into a Python number (``.item()``, ``int(t)``, ``bool(t)``). On a GPU each is a
host sync. Expert parallelism's split sizes are the one deliberate read (``host_split_sizes``,
a ``.tolist()``): they are counted separately. Rank 0 writes the counts as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from train.config import TrainConfig
from train.models import moe
from train.stop import StopRequest
from train.trainer import Trainer, init_distributed, preflight

HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.item.default"})


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value into Python."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in HOST_READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cfg = TrainConfig()
    cfg.run_dir = str(Path(args.out).parent / "run")
    cfg.model.preset = args.preset
    cfg.parallel.ep = args.ep
    cfg.data.corpus = args.corpus
    cfg.data.max_duration = 5.0
    cfg.data.num_workers = 0
    cfg.wandb.enabled = False
    prepared = preflight(cfg)
    device = init_distributed(cfg.train.hang_timeout_s)
    trainer = Trainer(cfg, prepared, device, StopRequest(0.0))
    batches = trainer.batches()
    trainer.train_step([next(batches)])  # the first step also measures the state's memory

    split_reads = []
    counted = moe.host_split_sizes

    def counting(send, recv):
        split_reads.append(1)
        return counted(send, recv)

    moe.host_split_sizes = counting
    step_batches = [[next(batches)] for _ in range(args.steps)]
    sizes = [len(batch[0]["token_lens"]) for batch in step_batches]
    with HostReads() as recorder:
        for batch in step_batches:
            trainer.train_step(batch)
    if dist.get_rank() == 0:
        result = {
            "reads": recorder.reads,
            "split_reads": len(split_reads),
            "moe_layers": trainer.model_cfg.n_layers if trainer.model_cfg.n_experts else 0,
            "batch_sizes": sizes,
        }
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
