"""The training fast path on one device: tokens/s, MFU and peak memory for compile x AC.

    python bench/bench_fast_path.py                       # llm_1b on one GPU, bf16 (FSDP2 MP)
    python bench/bench_fast_path.py --preset tiny --device cpu --steps 4 --warmup 1

Each configuration (compile on/off x activation checkpointing none/selective/full) runs in a
fresh process: the model the trainer builds (meta init, ``parallelize`` over a one-rank mesh,
bf16 parameters and fp32 reductions on CUDA), fused AdamW, a fixed synthetic batch of
``--batch`` utterances of ``--audio-seconds`` of audio and ``--text-tokens`` tokens each.
Steps are timed after ``--warmup`` steps (compilation happens there) with the device
synchronized. MFU is reported against the datasheet peak (``train.flops``) and against the bf16
matmul ceiling measured on the same GPU at the start of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [(compile_, ac) for compile_ in (False, True) for ac in ("none", "selective", "full")]


def matmul_ceiling(device) -> float:
    """Measured bf16 FLOP/s of a large square matmul (the practical peak of this GPU)."""
    import torch

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    runs = 20
    started = time.perf_counter()
    for _ in range(runs):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * runs / (time.perf_counter() - started)


def run_one(args: argparse.Namespace) -> dict:
    """One configuration in this process; returns its figures."""
    import torch
    import torch.distributed as dist

    from train.flops import peak_flops, step_flops
    from train.mesh import build_meshes
    from train.models.build import build_model
    from train.models.parallelize import ParallelizeOptions, compute_autocast
    from train.models.presets import get_preset
    from train.models.salm import audio_positions, loss_for_backward
    from train.parallel_dims import ParallelDims
    from train.step import host_seq_len
    from train.trainer import clip_grad_norm

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # set_device needs an index
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    cfg = get_preset(args.preset)
    options = ParallelizeOptions(activation_checkpointing=args.ac, compile=args.compile)
    meshes = build_meshes(ParallelDims(world_size=1), device.type)
    model = build_model(cfg, device, 1234, meshes, options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    frames = int(args.audio_seconds * 100)  # 10 ms fbank frames
    feature_lens = torch.full((args.batch,), frames)
    token_lens = torch.full((args.batch,), args.text_tokens)
    batch = [
        torch.randn(args.batch, frames, cfg.n_mels, device=device),
        feature_lens.to(device),
        torch.randint(0, 256, (args.batch, args.text_tokens), device=device),
        token_lens.to(device),
    ]
    targets = torch.tensor(float(args.batch * (args.text_tokens - 1)), device=device)
    sequences = torch.tensor(float(args.batch), device=device)
    positions = float((audio_positions(cfg, feature_lens) + token_lens).sum())
    flops = step_flops(cfg, feature_lens, token_lens)
    # As the trainer: the packed length from the host lengths, no read from the device.
    seq_len = host_seq_len((None, feature_lens, None, token_lens), model)

    def step() -> None:
        with compute_autocast(options, device.type):
            out = model(*batch, seq_len=seq_len)
        loss_for_backward(out, targets, sequences, 1).backward()
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    step_time = (time.perf_counter() - started) / args.steps
    result = {
        "compile": args.compile,
        "ac": args.ac,
        "step_time_s": step_time,
        "tokens_per_s": positions / step_time,
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak_flops(name, os.environ)
        ceiling = matmul_ceiling(device)
        result.update(
            gpu=name,
            mfu_datasheet=flops / step_time / peak if peak else None,
            mfu_measured_ceiling=flops / step_time / ceiling,
            matmul_ceiling_tflops=ceiling / 1e12,
            peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30,
            peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
        )
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llm_1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--audio-seconds", type=float, default=20.0)
    parser.add_argument("--text-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ac", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ac is not None:  # a child: one configuration
        print(json.dumps(run_one(args)), flush=True)
        return
    print(
        f"{args.preset} on {args.device}: batch {args.batch} x {args.audio_seconds:g} s audio "
        f"+ {args.text_tokens} tokens, {args.steps} timed steps after {args.warmup}",
        flush=True,
    )
    header = f"{'compile':>7} {'ac':>9} {'step s':>8} {'tokens/s':>10}"
    if args.device.startswith("cuda"):
        header += f" {'MFU':>6} {'MFU/ceil':>8} {'mem GiB':>8}"
    print(header, flush=True)
    child = [sys.executable, __file__, *sys.argv[1:]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for compile_, ac in CONFIGS:
        command = [*child, "--ac", ac, *(["--compile"] if compile_ else [])]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(f"{compile_!s:>7} {ac:>9} failed: {done.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        line = f"{compile_!s:>7} {ac:>9} {r['step_time_s']:8.3f} {r['tokens_per_s']:10.0f}"
        if "gpu" in r:
            mfu = "n/a" if r["mfu_datasheet"] is None else f"{r['mfu_datasheet']:.1%}"
            line += f" {mfu:>6} {r['mfu_measured_ceiling']:8.1%} {r['peak_memory_gib']:8.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
