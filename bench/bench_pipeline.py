"""Pipeline parallelism on CPU (gloo): the schedules' measured bubble, and parameter bytes per rank.

    python -m bench.bench_pipeline            # about 2 minutes on 2 cores
    python -m bench.bench_pipeline --quick    # smoke run: 2 timed steps after 1 warm-up step

1. Bubble. One step is the forward and backward of a fixed synthetic global batch of 16
   equal-length utterances, with no optimizer step (gradients are zeroed between steps, outside
   the timing). At pp=2 it runs under ``torchrun --standalone --nproc-per-node=2`` (this file in
   its worker mode: one stage per rank, built by ``build_pipeline`` and fed by the trainer's
   ``PipelineRunner``) for 1f1b and gpipe at m = 2, 4, 8 microbatches; the pp=1 baseline runs
   the same batch cut into the same m microbatches (gradient accumulation) through
   ``WholeModelRunner`` in one process of its own, in the same run, so that CPU efficiency at a
   microbatch's size is not counted as bubble either way. The ideal pp=2 step is that pp=1 step
   / pp, the measured bubble is 1 - ideal / measured, printed
   next to the schedule's theoretical (p - 1) / (m + p - 1). A step time is the median of
   ``--steps`` steps after ``--warmup``; a pp=2 step starts from a barrier and takes the slower
   rank's time. Target: measured / theoretical <= 1.5 for 1f1b at m = 8. As in the trainer, the
   pp=2 stages are FSDP2-wrapped (over one rank) and the single process is not, so that cost
   counts against the pipeline.
2. Parameter bytes per rank at pp = 1, 2, 4: each pp rank's stages are built on the meta device
   (no processes) with the default parameter-balanced split; the largest rank is compared with
   pp=1. The pp=2 run reports the bytes its ranks really hold, as a check of that count.

The model is defined here (``CONFIG``), not a preset: 8 LLM blocks of width 384 behind a one-layer,
64-wide audio encoder on 1 s of audio (25 positions) and 231 tokens, so that compute dominates
communication and the pipelining runtime's fixed cost per microbatch (~10 ms per stage on this
CPU), and the balanced two-stage split (4 blocks each, the encoder on the first) gives the stages
about equal work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from train.loop.step import WholeModelRunner
from train.models.batch import Batch
from train.models.build import build_model, build_pipeline
from train.models.loss import loss_targets
from train.models.moe import local_shard
from train.models.parallelize import ParallelizeOptions
from train.models.pipeline import PipelineRunner, merged_view, pipeline_parts
from train.models.salm import SALM
from train.models.shape import SALMConfig
from train.parallel.dims import ParallelDims
from train.parallel.mesh import build_meshes
from train.parallel.pipeline_plan import pipeline_plan

REPO = Path(__file__).resolve().parents[1]
CONFIG = SALMConfig(
    enc_dim=64,
    enc_layers=1,
    enc_heads=4,
    enc_ffn_hidden=128,
    d_model=384,
    n_layers=8,
    n_heads=8,
    n_kv_heads=4,
    ffn_hidden=1024,
)
BATCH = 16  # examples: a multiple of every microbatch count
FRAMES = 100  # 1 s of 10 ms fbank frames: 25 encoder positions
TOKENS = 231  # decoder sequence 25 + 231 = 256
PP = 2
SCHEDULES = ("1f1b", "gpipe")
MICROBATCHES = (2, 4, 8)
PARAM_PP = (1, 2, 4)
INIT_SEED = 1234
MIB = 2**20


def synthetic_batch() -> Batch:
    """(features, feature lengths, tokens, token lengths): equal lengths, so every microbatch
    does the same work."""
    g = torch.Generator().manual_seed(0)
    return Batch(
        torch.randn(BATCH, FRAMES, CONFIG.n_mels, generator=g),
        torch.full((BATCH,), FRAMES),
        torch.randint(0, 256, (BATCH, TOKENS), generator=g),
        torch.full((BATCH,), TOKENS),
    )


def step_times(
    runner: WholeModelRunner | PipelineRunner,
    model: nn.Module,
    args: argparse.Namespace,
    accumulate: int = 1,
) -> list[float]:
    """Seconds of each timed forward+backward step (a barrier first when distributed); the
    batch is cut into ``accumulate`` microbatches of one step (pp=1's share of the same work)."""
    batch = synthetic_batch()
    size = BATCH // accumulate
    batches = [tuple(t[i * size : (i + 1) * size] for t in batch) for i in range(accumulate)]
    targets = loss_targets(batch.token_lens).float()
    sequences = torch.tensor(float(BATCH))
    times = []
    for step in range(args.warmup + args.steps):
        if dist.is_initialized():
            dist.barrier()
        started = time.perf_counter()
        runner.forward_backward(batches, targets, sequences, 1)
        elapsed = time.perf_counter() - started
        model.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(elapsed)
    return times


def param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters (of their local shards) that ``module`` holds."""
    return sum(local_shard(p).numel() * local_shard(p).element_size() for p in module.parameters())


def run_baseline(args: argparse.Namespace) -> dict:
    """pp=1: the batch through one unparallelized model, as a one-process trainer runs it, cut
    into the same microbatches as each pipeline row (so microbatch size is not what differs)."""
    model = build_model(CONFIG, torch.device("cpu"), INIT_SEED)
    runner = WholeModelRunner(model, torch.device("cpu"))
    return {
        "step_s": {
            str(m): statistics.median(step_times(runner, model, args, m)) for m in MICROBATCHES
        }
    }


def run_pipeline(args: argparse.Namespace) -> dict | None:
    """pp=2 under torchrun, every schedule x microbatch count; rank 0 returns the figures."""
    dist.init_process_group("gloo")
    dims = ParallelDims(world_size=dist.get_world_size(), pp=PP)
    dims.validate(CONFIG)
    meshes = build_meshes(dims, "cpu")
    device = torch.device("cpu")
    rows = []
    for schedule in SCHEDULES:
        for microbatches in MICROBATCHES:
            plan = pipeline_plan(CONFIG, PP, schedule, microbatches, 0, [])
            parts = build_pipeline(CONFIG, device, INIT_SEED, meshes, ParallelizeOptions(), plan)
            runner = PipelineRunner(parts, plan, meshes.pp.get_group(), device, torch.float32, 1)
            times = torch.tensor(step_times(runner, merged_view(parts), args))
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            rows.append([schedule, microbatches, statistics.median(times.tolist())])
    held: list[int | None] = [None] * dist.get_world_size()  # every plan here splits alike
    dist.all_gather_object(held, sum(param_bytes(part) for part in parts))
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"rows": rows, "rank_bytes": held} if rank == 0 else None


def bytes_per_rank(pp: int) -> tuple[tuple[int, ...], list[int]]:
    """The default stage split at ``pp`` and the parameter bytes of each pp rank's stages,
    counted on the meta device."""
    plan = pipeline_plan(CONFIG, pp, "1f1b", 0, 0, [])
    with torch.device("meta"):
        model = SALM(CONFIG)
    held = [sum(map(param_bytes, pipeline_parts(model, plan, rank))) for rank in range(pp)]
    return plan.split, held


def run_child(command: list[str], out: Path) -> dict:
    """Run one child process that writes its figures to ``out``; exit with its error if it
    fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--quick", action="store_true", help="2 timed steps after 1 warm-up")
    parser.add_argument("--mode", choices=["baseline", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 2, 1
    if args.mode is not None:  # a child: write its figures
        result = run_baseline(args) if args.mode == "baseline" else run_pipeline(args)
        if result is not None:
            Path(args.out).write_text(json.dumps(result))
        return

    print(
        f"model: CONFIG in this file (d_model {CONFIG.d_model}, {CONFIG.n_layers} LLM blocks, "
        f"{CONFIG.enc_layers}-layer {CONFIG.enc_dim}-wide encoder); batch {BATCH} x "
        f"({FRAMES} frames + {TOKENS} tokens); forward+backward only, no optimizer; median of "
        f"{args.steps} steps after {args.warmup}; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    child = ["-m", "bench.bench_pipeline", "--steps", str(args.steps), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as work:
        out = Path(work) / "baseline.json"
        baseline = run_child([sys.executable, *child, "--mode", "baseline", "--out", str(out)], out)
        out = Path(work) / "pipeline.json"
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        pipeline = run_child(
            [*torchrun, f"--nproc-per-node={PP}", *child, "--mode", "worker", "--out", str(out)],
            out,
        )

    ideals = {int(m): step / PP for m, step in baseline["step_s"].items()}
    steps = ", ".join(f"m={m}: {step * PP:.3f} s" for m, step in ideals.items())
    print(f"\npp=1 step over the same m microbatches ({steps}); ideal pp={PP} step = that / {PP}\n")
    print(
        "| schedule | m | measured step s | ideal s | measured bubble | theoretical bubble "
        "| ratio measured/theoretical |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for schedule, microbatches, measured in pipeline["rows"]:
        ideal = ideals[microbatches]
        bubble = 1 - ideal / measured
        theoretical = (PP - 1) / (microbatches + PP - 1)
        ratios[schedule, microbatches] = bubble / theoretical
        print(
            f"| {schedule} | {microbatches} | {measured:.3f} | {ideal:.3f} | {bubble:.3f} "
            f"| {theoretical:.3f} | {ratios[schedule, microbatches]:.2f} |"
        )
    print(f"\n1f1b at m=8: measured/theoretical {ratios['1f1b', 8]:.2f} (target <= 1.5)\n")

    print("| pp | LLM blocks per stage | MiB per rank | max MiB | max / pp=1 |")
    print("|---:|---|---|---:|---:|")
    counts = {pp: bytes_per_rank(pp) for pp in PARAM_PP}
    whole = max(counts[1][1])
    for pp, (split, held) in counts.items():
        print(
            f"| {pp} | {', '.join(map(str, split))} | {', '.join(f'{b / MIB:.2f}' for b in held)} "
            f"| {max(held) / MIB:.2f} | {max(held) / whole:.3f} |"
        )
    check = "equal to" if pipeline["rank_bytes"] == counts[PP][1] else "DIFFERENT from"
    print(
        f"\nthe pp={PP} ranks held {', '.join(f'{b / MIB:.2f}' for b in pipeline['rank_bytes'])} "
        f"MiB of parameters, {check} the meta-device count"
    )
    print(f"load average at the end {os.getloadavg()[0]:.2f} (other work skews the timings)")


if __name__ == "__main__":
    main()
