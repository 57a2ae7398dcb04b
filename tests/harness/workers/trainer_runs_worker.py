"""Several trainer runs in one process group, one after another: each a ``Trainer`` built from
the packaged config and its overrides and run to its end, as ``python -m train`` runs one.

``tests/test_trainer_equivalence.py`` trains ~20 layouts for a few steps each; started one
process group per run, process start-up (torch's import on every rank) was most of each case's
time. Here the ranks start once per world size. Dynamo's caches are reset before each run, so
a compiled run compiles as in a process of its own (and no run spends another's recompile
budget). What the command adds around the trainer (the launch variables, the end-of-job record,
exit codes) is tested by tests/test_trainer.py.

Usage: ``[torchrun --nproc-per-node=N] python -m tests.harness.workers.trainer_runs_worker
SPEC.json``, where SPEC holds ``{"config": NAME, "runs": [[override, ...], ...]}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch._dynamo
import torch.distributed as dist

from orchestrator.planner.plan_check import compose_training_config
from train.loop.garbage import pause as pause_collector
from train.loop.stop import StopRequest
from train.parallel.distributed import init_distributed
from train.trainer import Trainer, preflight


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    pause_collector()  # as python -m train does before it imports and builds (loop/garbage.py)
    device = init_distributed()
    for overrides in spec["runs"]:
        torch._dynamo.reset()
        cfg = compose_training_config(["--config-name", spec["config"], *overrides])
        prepared = preflight(cfg)
        stop = StopRequest(cfg.train.max_time_per_run)
        stop.install()
        code = Trainer(cfg, prepared, device, stop).run()
        if code:
            raise SystemExit(f"run {overrides} ended with exit code {code}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
