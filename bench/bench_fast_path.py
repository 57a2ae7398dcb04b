"""The training fast path on one device: tokens/s, MFU and peak memory for compile x AC.

    python -m bench.bench_fast_path                       # llm_1b on one GPU, bf16 (FSDP2 MP)
    python -m bench.bench_fast_path --preset tiny --device cpu --steps 4 --warmup 1

Each configuration (compile on/off x activation checkpointing none/selective/full) runs in a
fresh process (``--runs`` runs a list of them in one process, as bench/gpu_check.py does): the
model the trainer builds (meta init, ``parallelize`` over a one-rank mesh, bf16 parameters and
fp32 reductions on CUDA), fused AdamW, a fixed synthetic batch of ``--batch`` utterances of
``--audio-seconds`` of audio and ``--text-tokens`` tokens each. Steps are timed after
``--warmup`` steps (compilation happens there) with the device synchronized, under CUDA's sync
debug mode (``--host-syncs``, default error: a host sync in a step fails the configuration).
MFU is reported against the datasheet peak (``train.flops``) and against the bf16 matmul
ceiling measured on the same GPU at the start of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from train.loop.host_syncs import HOST_SYNC_MODES
from train.parallel.dims import AC_MODES

REPO = Path(__file__).resolve().parents[1]

CONFIGS = [(compile_, ac) for compile_ in (False, True) for ac in AC_MODES]


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


def parse_run(spec: str) -> tuple[bool, str, int, float, int]:
    """``compiled:selective:8x20x128`` as (compile, AC mode, utterances, audio s, tokens)."""
    mode, ac, batch = spec.split(":")
    utterances, seconds, tokens = batch.split("x")
    if mode not in ("eager", "compiled") or ac not in AC_MODES:
        raise ValueError(f"{spec!r} is not eager|compiled:{'|'.join(AC_MODES)}:UxSxT")
    return mode == "compiled", ac, int(utterances), float(seconds), int(tokens)


def run_spec(compile_: bool, ac: str, batch: tuple[int, float, int]) -> str:
    """The inverse of ``parse_run``."""
    utterances, seconds, tokens = batch
    return f"{'compiled' if compile_ else 'eager'}:{ac}:{utterances}x{seconds:g}x{tokens}"


def start(device_name: str):
    """This process's device and its one-rank process group."""
    import torch
    import torch.distributed as dist

    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # set_device needs an index
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def run_one(args: argparse.Namespace, spec: str, device, ceiling: float | None) -> dict:
    """One configuration in this process (the model built afresh, dynamo's caches reset);
    its figures. Timed steps run under ``args.host_syncs`` (a host sync raises on CUDA)."""
    import torch

    from train.flops import peak_flops, step_flops
    from train.loop.host_syncs import checked_for_host_syncs
    from train.loop.step import host_seq_len
    from train.models.batch import Batch
    from train.models.build import build_model
    from train.models.loss import loss_for_backward
    from train.models.parallelize import ParallelizeOptions, compute_autocast
    from train.models.presets import get_preset
    from train.models.shape import audio_positions
    from train.parallel.dims import ParallelDims
    from train.parallel.distributed import clip_grad_norm
    from train.parallel.mesh import build_meshes

    compile_, ac, utterances, seconds, tokens = parse_run(spec)
    torch._dynamo.reset()
    cfg = get_preset(args.preset)
    options = ParallelizeOptions(activation_checkpointing=ac, compile=compile_)
    meshes = build_meshes(ParallelDims(world_size=1), device.type)
    model = build_model(cfg, device, 1234, meshes, options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    frames = int(seconds * 100)  # 10 ms fbank frames
    feature_lens = torch.full((utterances,), frames, device="cpu")
    token_lens = torch.full((utterances,), tokens, device="cpu")
    batch = Batch(
        torch.randn(utterances, frames, cfg.n_mels, device=device),
        feature_lens.to(device),
        torch.randint(0, 256, (utterances, tokens), device=device),
        token_lens.to(device),
    )
    targets = torch.tensor(float(utterances * (tokens - 1)), device=device)
    sequences = torch.tensor(float(utterances), device=device)
    positions = float((audio_positions(cfg, feature_lens) + token_lens).sum())
    flops = step_flops(cfg, feature_lens, token_lens)
    # As the trainer: the packed length from the host lengths, no read from the device.
    seq_len = host_seq_len(Batch(None, feature_lens, None, token_lens), model)

    def step() -> None:
        with compute_autocast(options, device.type):
            out = model(batch, seq_len=seq_len)
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
    with checked_for_host_syncs(args.host_syncs, device):
        for _ in range(args.steps):
            step()
    sync()
    step_time = (time.perf_counter() - started) / args.steps
    result = {
        "compile": compile_,
        "ac": ac,
        "batch": [utterances, seconds, tokens],
        "step_time_s": step_time,
        "tokens_per_s": positions / step_time,
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak_flops(name, os.environ)
        result.update(
            gpu=name,
            mfu_datasheet=flops / step_time / peak if peak else None,
            mfu_measured_ceiling=flops / step_time / ceiling,
            matmul_ceiling_tflops=ceiling / 1e12,
            peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30,
            peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
        )
    return result


def run_all(args: argparse.Namespace) -> None:
    """Every ``--runs`` configuration in this process, one JSON line each; a configuration
    that fails prints its error and the rest still run."""
    import torch
    import torch.distributed as dist

    device = start(args.device)
    ceiling = matmul_ceiling(device) if device.type == "cuda" else None
    for spec in args.runs.split(","):
        try:
            result = run_one(args, spec, device, ceiling)
        except Exception as error:  # one failed configuration is a result; the rest still run
            compile_, ac, *batch = parse_run(spec)
            message = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            result = {"compile": compile_, "ac": ac, "batch": batch, "error": message}
        if device.type == "cuda":  # the finished model's memory back before the next
            torch.cuda.empty_cache()
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llm_1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--audio-seconds", type=float, default=20.0)
    parser.add_argument("--text-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--host-syncs",
        choices=HOST_SYNC_MODES,
        default="error",
        help="CUDA's sync debug mode over the timed steps (default error: a host sync fails)",
    )
    parser.add_argument(
        "--runs",
        help="configurations to run in this one process, e.g. compiled:selective:8x20x128 "
        "(compile:AC:utterances x seconds x tokens); one JSON line each",
    )
    args = parser.parse_args()
    if args.runs is not None:
        run_all(args)
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
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    batch = (args.batch, args.audio_seconds, args.text_tokens)
    for compile_, ac in CONFIGS:  # each in a fresh process: its memory figures its own
        command = [sys.executable, "-m", "bench.bench_fast_path", *sys.argv[1:]]
        command += ["--runs", run_spec(compile_, ac, batch)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        if done.returncode != 0:
            print(f"{compile_!s:>7} {ac:>9} failed: {done.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        if "error" in r:
            print(f"{compile_!s:>7} {ac:>9} failed: {r['error']}")
            continue
        line = f"{compile_!s:>7} {ac:>9} {r['step_time_s']:8.3f} {r['tokens_per_s']:10.0f}"
        if "gpu" in r:
            mfu = "n/a" if r["mfu_datasheet"] is None else f"{r['mfu_datasheet']:.1%}"
            line += f" {mfu:>6} {r['mfu_measured_ceiling']:8.1%} {r['peak_memory_gib']:8.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
