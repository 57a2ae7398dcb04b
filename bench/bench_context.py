"""Context parallelism on CPU: per-rank activation memory and step time at cp = 1, 2, 4.

    python -m bench.bench_context                          # tiny, one 8192-position example
    python -m bench.bench_context --preset small --positions 4096
    python -m bench.bench_context --quick                  # 1024 positions: a smoke run

Each CP degree runs as ``torchrun --standalone --nproc-per-node=<cp>`` of this file's
``--worker`` mode (cp = 1 as one rank of the same code), on gloo with one thread per rank. The
batch is ONE example whose decoder sequence is ``--positions`` long: ``--text-tokens`` of
transcript after audio of 4 x (positions - text tokens) fbank frames (the encoder subsamples
by 4). The model is the one the trainer builds (``build_model`` over the CP layout: the LLM's
sequence split into 2 x cp chunks, FSDP over the CP ranks), stepped through the trainer's
``WholeModelRunner`` and fused AdamW.

Step time is the median wall time of ``--steps`` steps after ``--warmup`` (ranks synchronized
by a barrier before and after each step). The ranks share this machine's cores, so once
cp exceeds them the wall time is oversubscribed; the per-rank CPU time (the busiest rank's
median) is the work each rank does.

Memory is PyTorch's own accounting of real tensors: one more step runs under
``torch.distributed._tools.mem_tracker.MemTracker`` (a TorchDispatchMode that follows every
tensor storage as it is allocated and freed, by kind, with snapshots as each module enters,
leaves and peaks in forward and backward). Per rank, the busiest rank reported:

- encoder / LLM activation peak: activation plus backward temporary memory (``Activation`` +
  ``Temp``) at the module's highest point in its forward or its backward, above what it was
  when the module's forward began;
- encoder held: what the encoder's forward leaves allocated for its backward, which stays
  resident through the whole LLM forward and backward;
- attention held: the same over the LLM's attention modules (their saved tensors, including the
  gathered K/V, plus their outputs);
- step peak: everything allocated at the step's highest point (parameters, gradients, optimizer
  state, activations, temporaries). Under CP, FSDP's gathered parameters count as activations
  (a few MiB at most for these presets).

The audio encoder is not split by CP: every rank encodes the whole utterance, so its memory
does not fall with cp. It grows linearly with the utterance (its convolutions run at the frame
rate and CPU attention is flash attention, with no positions x positions tensor), so the last
line turns its measured bytes per position into the most positions a GiB per rank can hold,
whatever cp.
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

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
SEED = 1234


def worker(args: argparse.Namespace) -> None:
    """One CP degree (this process is one rank of it); rank 0 writes every rank's figures."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    from train.loop.step import WholeModelRunner, host_seq_len
    from train.models.batch import Batch
    from train.models.build import build_model
    from train.models.loss import loss_targets
    from train.models.parallelize import ParallelizeOptions
    from train.models.presets import get_preset
    from train.parallel.dims import ParallelDims
    from train.parallel.mesh import build_meshes

    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    cfg = get_preset(args.preset)
    dims = ParallelDims(world_size=cp, cp=cp)
    dims.validate(cfg)
    device = torch.device("cpu")
    model = build_model(cfg, device, SEED, build_meshes(dims, "cpu"), ParallelizeOptions())
    runner = WholeModelRunner(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    g = torch.Generator().manual_seed(SEED)
    frames = 4 * (args.positions - args.text_tokens)
    feature_lens = torch.tensor([frames])
    token_lens = torch.tensor([args.text_tokens])
    batch = Batch(
        torch.randn(1, frames, cfg.n_mels, generator=g),
        feature_lens,
        torch.randint(0, 256, (1, args.text_tokens), generator=g),
        token_lens,
    )
    targets = loss_targets(token_lens).float()
    sequences = torch.tensor(1.0)
    seq_len = host_seq_len(batch, model)

    def step() -> None:
        runner.forward_backward([batch], targets, sequences, dims.gradient_ranks)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    walls, cpus = [], []
    for index in range(args.warmup + args.steps):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        cpu = time.process_time() - cpu
        dist.barrier()
        if index >= args.warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(cpu)

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    stats = tracker.memory_tracking
    moving = (_MemRefType.ACT, _MemRefType.TEMP)

    def snapshot(module: torch.nn.Module, state: _ModState) -> dict:
        """The module's first snapshot in ``state`` on the CPU (empty if nothing was live)."""
        return stats[module].snapshots[state][0].get(device, {})

    def held(module: torch.nn.Module) -> int:
        """Activation bytes the module's forward leaves allocated."""
        before, after = snapshot(module, _ModState.PRE_FW), snapshot(module, _ModState.POST_FW)
        return after.get(_MemRefType.ACT, 0) - before.get(_MemRefType.ACT, 0)

    def activation_peak(module: torch.nn.Module) -> int:
        """Activation + temporary bytes at the module's peak, above its pre-forward level."""
        start = sum(snapshot(module, _ModState.PRE_FW).get(kind, 0) for kind in moving)
        peaks = (snapshot(module, state) for state in (_ModState.PEAK_FW, _ModState.PEAK_BW))
        return max(sum(peak.get(kind, 0) for kind in moving) for peak in peaks) - start

    peak = tracker.get_tracker_snapshot("peak")[device]
    figures = {
        "seq_len": seq_len,
        "encoder_peak": activation_peak(model.encoder),
        "encoder_held": held(model.encoder),
        "llm_peak": activation_peak(model.llm),
        "attention_held": sum(held(block.attn) for block in model.llm.layers.values()),
        "step_peak": peak["Total"],
        "step_s": statistics.median(walls),
        "cpu_s": statistics.median(cpus),
    }
    gathered: list[dict | None] = [None] * cp
    dist.all_gather_object(gathered, figures)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_cp(cp: int, args: argparse.Namespace, out: Path) -> dict:
    """Launch one CP degree under torchrun; returns its busiest rank's figures."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        f"--nproc-per-node={cp}",
        *("-m", "bench.bench_context"),
        "--worker",
        f"--out={out}",
        f"--preset={args.preset}",
        f"--positions={args.positions}",
        f"--text-tokens={args.text_tokens}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"cp={cp} failed:\n{done.stderr[-4000:]}")
    ranks = json.loads(out.read_text())
    return {key: max(rank[key] for rank in ranks) for key in ranks[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--positions", type=int, default=8192, help="decoder sequence length")
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1024 positions, 1 timed step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.positions, args.text_tokens, args.steps, args.warmup = 1024, 32, 1, 1
    multiple = 8 * max(args.cp)
    if args.positions % multiple:
        parser.error(f"--positions must be a multiple of {multiple} (8 x the largest cp)")
    print(
        f"{args.preset}: one example of {args.positions} decoder positions "
        f"({args.text_tokens} text tokens after {4 * (args.positions - args.text_tokens)} fbank "
        f"frames), median of {args.steps} steps after {args.warmup}; {os.cpu_count()} CPU "
        "cores shared by the ranks, one thread each; memory by MemTracker (MiB per rank)",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-context-") as tmp:
        for cp in args.cp:
            rows.append((cp, run_cp(cp, args, Path(tmp) / f"cp{cp}.json")))
    base_cp, base = rows[0]
    versus = f"vs cp={base_cp}"
    print(
        "\n| cp | positions/rank | encoder act peak | encoder held | LLM act peak | "
        f"attention held | step peak | step s | CPU s/rank | LLM act {versus} | "
        f"step peak {versus} | step s {versus} |"
    )
    print("|" + "---:|" * 12)
    for cp, r in rows:
        print(
            f"| {cp} | {r['seq_len'] // cp} | {r['encoder_peak'] / MIB:.1f} | "
            f"{r['encoder_held'] / MIB:.1f} | {r['llm_peak'] / MIB:.1f} | "
            f"{r['attention_held'] / MIB:.1f} | {r['step_peak'] / MIB:.1f} | "
            f"{r['step_s']:.2f} | {r['cpu_s']:.2f} | {r['llm_peak'] / base['llm_peak']:.2f} | "
            f"{r['step_peak'] / base['step_peak']:.2f} | {r['step_s'] / base['step_s']:.2f} |"
        )
    cp, last = rows[-1]
    encoder = last["encoder_peak"]
    per_position = encoder / last["seq_len"]
    print(
        f"\nThe audio encoder is not split by CP: every rank holds its {encoder / MIB:.0f} MiB "
        f"of activations ({per_position / 2**10:.0f} KiB per position), "
        f"{encoder / last['llm_peak']:.1f}x the LLM's per-rank activation peak at cp={cp}. "
        "No cp takes a rank's activation memory below it: each GiB per rank holds the "
        f"encoder's activations for at most {2**30 / per_position:,.0f} positions."
    )


if __name__ == "__main__":
    main()
