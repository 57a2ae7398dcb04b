"""The demo job: a small, real torch.distributed program that checks what a chain's job relies on.

Started by torchrun, by srun with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT exported, or as a single
process with none of them. It joins the process group (gloo on CPU, nccl with CUDA), checks an
all_reduce, derives each rank's data seed from (job seed, data-parallel rank) with numpy's
SeedSequence, checks on rank 0 that the seeds are distinct, prints one summary, then "trains"
(sleeps) for --steps steps. On SIGUSR1 or SIGTERM every rank agrees at the next step boundary to
stop, and the job exits 0, as a trainer does after saving. Rank 0 appends one JSON line to
$ORCH_RUN_DIR/smoke.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from train.loop.stop import ignore_usr1_from_exit


class StopRequest:
    """Set from a signal handler; acted on at a step boundary, where all ranks agree."""

    def __init__(self) -> None:
        self.requested = False

    def handle(self, _signum: int, _frame: object) -> None:
        self.requested = True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True, help="the job's seed")
    parser.add_argument("--steps", type=int, default=10, help="steps to 'train'")
    parser.add_argument("--sleep", type=float, default=0.5, help="seconds per step")
    return parser.parse_args(argv)


def data_seed(job_seed: int, dp_rank: int) -> int:
    """Rank ``dp_rank``'s data seed: the dp_rank-th child of the job seed's SeedSequence.

    Collision-free by construction, unlike ``job_seed + dp_rank`` arithmetic, which makes job
    seeds s and s+1 share all but one rank's stream.
    """
    sequence = np.random.SeedSequence(job_seed, spawn_key=(dp_rank,))
    return int(sequence.generate_state(1)[0])


def init_process_group() -> torch.device:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def check_all_reduce(device: torch.device, world_size: int) -> None:
    value = torch.tensor([dist.get_rank() + 1], dtype=torch.int64, device=device)
    dist.all_reduce(value)
    expected = world_size * (world_size + 1) // 2
    if value.item() != expected:
        raise RuntimeError(f"all_reduce gave {value.item()}, expected {expected}")


def train(args: argparse.Namespace, stop: StopRequest, device: torch.device) -> tuple[int, bool]:
    """Sleep-steps until done or until any rank was signalled; (steps done, stopped on signal)."""
    for step in range(args.steps):
        time.sleep(args.sleep)
        flag = torch.tensor([int(stop.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            if dist.get_rank() == 0:
                print(f"stopping at step {step + 1} on signal", flush=True)
            return step + 1, True
    return args.steps, False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = StopRequest()
    signal.signal(signal.SIGUSR1, stop.handle)
    signal.signal(signal.SIGTERM, stop.handle)
    ignore_usr1_from_exit()

    device = init_process_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_all_reduce(device, world_size)
    mine = {
        "rank": rank,
        "node": os.environ.get("SLURM_NODEID", "-"),
        "host": socket.gethostname(),
        "data_seed": data_seed(args.seed, rank),  # every rank is a data-parallel rank here
    }
    ranks: list[dict] = [{} for _ in range(world_size)]
    dist.all_gather_object(ranks, mine)
    job_index = os.environ.get("ORCH_JOB_INDEX")
    if rank == 0:
        seeds = [entry["data_seed"] for entry in ranks]
        if len(set(seeds)) != len(seeds):
            raise RuntimeError(f"data seeds collide across ranks: {seeds}")
        per_rank = ", ".join(
            f"rank {e['rank']} node {e['node']} ({e['host']}) data seed {e['data_seed']}"
            for e in ranks
        )
        print(
            f"smoke: job index {job_index} seed {args.seed} world size {world_size}: {per_rank}",
            flush=True,
        )

    steps_done, stopped = train(args, stop, device)
    if rank == 0:
        print(f"smoke: {steps_done} step(s) done", flush=True)
        record = {
            "job_index": None if job_index is None else int(job_index),
            "seed": args.seed,
            "world_size": world_size,
            "data_seeds": [entry["data_seed"] for entry in ranks],
            "ranks": ranks,
            "steps_done": steps_done,
            "stopped_on_signal": stopped,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        }
        run_dir = os.environ.get("ORCH_RUN_DIR")
        if run_dir:
            with (Path(run_dir) / "smoke.jsonl").open("a") as out:
                out.write(json.dumps(record) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
