"""The planner's activation formula against measured peaks, and the planner's own speed.

    python -m bench.bench_planner              # tiny and small, every AC mode, two batch shapes
    python -m bench.bench_planner --json       # the same as one JSON list (tests read it)
    python -m bench.bench_planner --cases tiny:4:800:40:none

Each case trains one step of the preset in this process (one rank, gloo, CPU, fp32, the
trainer's model build and fused AdamW) after one warm-up step, under PyTorch's ``MemTracker``
(a TorchDispatchMode that follows every storage by kind). The measured activation memory is
what the tracker files as activations and temporaries at the step's peak; parameters,
gradients and optimizer states are the planner's exact part (tests/test_planner_memory.py).
A case is ``preset:sequences:frames:tokens:ac`` (frames of fbank at 100 per second).

Last, it times ``orchestrator plan`` for a 70B-class model on 256 GPUs (the search alone, in
process, median of 5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from train.parallel.dims import AC_MODES

REPO = Path(__file__).resolve().parents[1]

DEFAULT_CASES = [
    f"{preset}:{shape}:{ac}"
    for preset in ("tiny", "small")
    for shape in ("4:800:40", "2:1600:120")
    for ac in AC_MODES
]


def measure(preset: str, sequences: int, frames: int, tokens: int, ac: str) -> int:
    """Activation + temporary bytes at the peak of one training step."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from train.loop.step import WholeModelRunner
    from train.models.batch import Batch
    from train.models.build import build_model
    from train.models.loss import loss_targets
    from train.models.parallelize import ParallelizeOptions
    from train.models.presets import get_preset
    from train.parallel.dims import ParallelDims
    from train.parallel.mesh import build_meshes

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cpu")
    dims = ParallelDims(world_size=1)
    options = ParallelizeOptions(activation_checkpointing=ac)
    model = build_model(get_preset(preset), device, 1234, build_meshes(dims, "cpu"), options)
    runner = WholeModelRunner(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    token_lens = torch.full((sequences,), tokens)
    batch = Batch(
        torch.randn(sequences, frames, 80, generator=g),
        torch.full((sequences,), frames),
        torch.randint(0, 256, (sequences, tokens), generator=g),
        token_lens,
    )
    targets, count = loss_targets(token_lens).float(), torch.tensor(float(sequences))

    def step() -> None:
        runner.forward_backward([batch], targets, count, 1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[device]
    return peak.get(_MemRefType.ACT, 0) + peak.get(_MemRefType.TEMP, 0)


def predict(preset: str, sequences: int, frames: int, tokens: int, ac: str) -> float:
    from orchestrator.planner.activations import ActivationLayout, Microbatch, activation_bytes
    from train.models.presets import get_preset

    batch = Microbatch(sequences=sequences, frames=frames, tokens=tokens)
    return activation_bytes(get_preset(preset), batch, ActivationLayout(ac=ac)).peak


def time_plan() -> float:
    from contract.gpus import gpu_preset
    from orchestrator.planner.cluster import Cluster
    from orchestrator.planner.request import PlanRequest
    from orchestrator.planner.search import plan
    from train.models.presets import get_preset

    request = PlanRequest(
        model=get_preset("llama_70b"),
        seconds=30.0,
        tokens=256,
        global_batch=512,
        cluster=Cluster(gpus=256, gpus_per_node=8, gpu=gpu_preset("h100")),
    )
    times = []
    for _ in range(5):
        started = time.perf_counter()
        plan(request)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-timing", action="store_true", help="skip timing the planner")
    args = parser.parse_args()
    rows = []
    for case in args.cases:
        preset, sequences, frames, tokens, ac = case.split(":")
        shape = (preset, int(sequences), int(frames), int(tokens), ac)
        measured, predicted = measure(*shape), predict(*shape)
        rows.append(
            {
                "case": case,
                "measured_bytes": measured,
                "predicted_bytes": predicted,
                "error": predicted / measured - 1,
            }
        )
        if not args.json:
            print(
                f"{case:28s} measured {measured / 2**20:8.1f} MiB  planner "
                f"{predicted / 2**20:8.1f} MiB  error {100 * rows[-1]['error']:+5.1f}%",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows))
        return
    worst = max(rows, key=lambda row: abs(row["error"]))
    print(f"worst activation error: {100 * worst['error']:+.1f}% ({worst['case']})")
    if not args.no_timing:
        print(f"plan for a 70B model on 256 H100s: {1000 * time_plan():.0f} ms (median of 5)")


if __name__ == "__main__":
    main()
