"""Bytes and seconds of one checkpoint of the real SALM with its frozen pretrained parts held by
reference (``checkpoint.by_reference``, the default) against the save before it (the baseline:
the whole model, each parameter's optimizer hyperparameters saved apart, as every checkpoint was
until 2026-11-30) and against the whole model saved today (``checkpoint.by_reference=false``,
hyperparameters once: ``train.checkpoint.hyperparameters``).

    python -m bench.bench_checkpoint_refs                 # about a minute; needs `make pretrained`

The trainer of ``recipes/conf/salm_pretrained.yaml`` (SmolLM2-135M-Instruct with LoRA rank 8,
Whisper tiny.en's encoder frozen, the projector) is built in this process, as a job builds it
(a gloo group of one, the pretrained weights loaded), and takes one AdamW step on random
gradients so that its optimizer state exists. Then each way saves ``--saves`` times, in turn,
synchronously (``CheckpointManager.save``: the state dict, the DCP write with fsync, the marker
and the rename) into a run dir under ``--dir`` (default: a temporary dir on /tmp's disk).
Printed: each way's bytes on disk and median seconds, and the ratios (targets against before:
bytes <= 0.05x, seconds <= 0.2x). The part digests are taken as a job starts
(``identify_pretrained``), not in the save, and Python's collector runs between saves, not in
them, as in the trainer.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import train.checkpoint.manager as manager_module
from orchestrator.planner.plan_check import compose_training_config
from train.checkpoint.hyperparameters import shared
from train.checkpoint.manager import CheckpointManager
from train.loop.garbage import pause as pause_collector
from train.loop.stop import StopRequest
from train.trainer import Trainer, preflight

TARGETS = {"bytes": 0.05, "seconds": 0.2}
BEFORE = "before: the whole model, hyperparameters apart"
WHOLE = "whole: checkpoint.by_reference=false"
AFTER = "after: by reference"


def stepped_trainer(run_dir: Path, corpus: str) -> Trainer:
    """The real SALM's trainer after one AdamW step on random gradients."""
    settings = (f"run_dir={run_dir}", f"data.corpus={corpus}", "wandb.mode=disabled", "seed=1")
    cfg = compose_training_config(["--config-name", "salm_pretrained", *settings])
    trainer = Trainer(cfg, preflight(cfg), torch.device("cpu"), StopRequest(0.0))
    trainer.restore()
    for param in trainer.model.parameters():
        if param.requires_grad:
            param.grad = torch.randn_like(param) * 1e-3
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.step = 1
    return trainer


def on_disk(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--corpus", default="data/corpus_asr")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pause_collector()  # as `python -m train` runs: the trainer's Collector decides collections
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        trainer = stepped_trainer(Path(root) / "run", args.corpus)
        held = trainer.checkpoints
        ways = {
            BEFORE: CheckpointManager(Path(root) / "before", keep=1),
            WHOLE: CheckpointManager(Path(root) / "whole", keep=1),
            AFTER: CheckpointManager(
                Path(root) / "refs",
                keep=1,
                pretrained=held.pretrained,
                by_reference=held.by_reference,
            ),
        }
        ways[AFTER].identify_pretrained()
        state = trainer.trainer_state()
        objects = (trainer.model, trainer.optimizer, trainer.scheduler)
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        sizes: dict[str, int] = {}
        with trainer.collector:
            for step in range(1, args.saves + 2):  # the first save of each way warms up
                for name, manager in ways.items():
                    # Before: each parameter's hyperparameters saved apart.
                    manager_module.shared = (lambda state: state) if name == BEFORE else shared
                    started = time.perf_counter()
                    path = manager.save(step, *objects, state)
                    if step > 1:
                        seconds[name].append(time.perf_counter() - started)
                    sizes[name] = on_disk(path)
                trainer.collector.at_pause()  # the full collection after a save, as training
            for manager in ways.values():
                manager.finish()
    dist.destroy_process_group()
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    print(f"one synchronous save of the real SALM (LoRA rank 8), median of {args.saves}:")
    for name in ways:
        print(f"  {name:46} {sizes[name] / 2**20:9.1f} MiB {medians[name]:8.2f} s")
    for base in (BEFORE, WHOLE):
        ratios = {"bytes": sizes[AFTER] / sizes[base], "seconds": medians[AFTER] / medians[base]}
        said = ", ".join(f"{what} {ratio:.3f}x" for what, ratio in ratios.items())
        print(f"  by reference against {base.split(':')[0]}: {said}")
    targets = ", ".join(f"{what} <= {target}x" for what, target in TARGETS.items())
    print(f"  targets against before: {targets}")


if __name__ == "__main__":
    main()
