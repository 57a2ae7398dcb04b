"""What one GPU's kernels reach: the figures the planner's step-time terms are calibrated with.

    python -m bench.bench_kernels --out runs/kernels.json      # on a GPU
    python -m bench.bench_kernels --device cpu --quick         # the same code, reduced, on CPU

- bf16 matmuls of a transformer's shapes (tokens x width @ width x width, x FFN width, x
  vocabulary) at several token counts: achieved FLOP/s, as a share of the datasheet peak;
- causal attention (``scaled_dot_product_attention``, the flash kernel on Hopper) forward and
  forward + backward at several sequence lengths, head width 128: FLOP/s counting the causal
  half only (what the kernel does);
- memory bandwidth: a copy, and the fp32 cross-entropy of a large vocabulary forward and
  backward (the loss's memory-bound cost per token).

Prints one table and writes JSON (``--out``); docs/planner.md cites the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

WIDTHS = ((1024, 4096), (2048, 5632), (4096, 14336), (8192, 28672))  # (d, FFN width)
TOKENS = (2048, 8192, 16384)
SEQUENCES = (1024, 2048, 4096, 8192)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call, after two warm-up calls."""
    for _ in range(2):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - started) / repeats


def matmuls(device, dtype, tokens, widths, repeats) -> list[dict]:
    rows = []
    for m in tokens:
        for d, f in widths:
            for name, k, n in (("d x d", d, d), ("d x ffn", d, f), ("ffn x d", f, d)):
                a = torch.randn(m, k, device=device, dtype=dtype)
                b = torch.randn(k, n, device=device, dtype=dtype)
                seconds = timed(lambda a=a, b=b: a @ b, device, repeats)
                rows.append(
                    {"m": m, "k": k, "n": n, "shape": name, "flops": 2 * m * k * n / seconds}
                )
    return rows


def attention(device, dtype, sequences, tokens, repeats) -> list[dict]:
    rows = []
    heads, width = 32, 128
    for s in sequences:
        batch = max(1, tokens // s)
        q, k, v = (
            torch.randn(batch, heads, s, width, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        causal = 2 * 2 * batch * heads * width * s * s / 2  # two matmuls, the causal half

        def forward(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both(q=q, k=k, v=v):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        fwd = timed(forward, device, repeats)
        train = timed(both, device, repeats)
        rows.append(
            {
                "seq": s,
                "batch": batch,
                "fwd_flops": causal / fwd,
                "train_flops": 3.5 * causal / train,
            }
        )
    return rows


def bandwidth(device, repeats, elements: int) -> dict:
    x = torch.empty(elements, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy = timed(lambda: y.copy_(x), device, repeats)
    return {"copy_bytes_per_s": 2 * x.numel() * x.element_size() / copy}


def cross_entropy(device, tokens: int, vocab: int, repeats: int) -> dict:
    logits = torch.randn(tokens, vocab, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=device)

    def step():
        F.cross_entropy(logits.float(), targets).backward()

    seconds = timed(step, device, repeats)
    return {"tokens": tokens, "vocab": vocab, "seconds": seconds, "per_token_s": seconds / tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU run)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; on a machine without one use --device cpu --quick")
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    quick = args.quick
    tokens = (256,) if quick else TOKENS
    widths = ((128, 512),) if quick else WIDTHS
    repeats = 2 if quick else 10
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "matmul": matmuls(device, dtype, tokens, widths, repeats),
        "attention": attention(
            device, dtype, (256,) if quick else SEQUENCES, 512 if quick else 16384, repeats
        ),
        "bandwidth": bandwidth(device, repeats, 2**20 if quick else 2**29),
        "cross_entropy": cross_entropy(device, *((256, 1024) if quick else (16384, 128256)), 3),
    }
    print(f"kernels on {result['device']}")
    print("| matmul m x k x n | TFLOP/s |\n| --- | ---: |")
    for r in result["matmul"]:
        print(f"| {r['m']} x {r['k']} x {r['n']} ({r['shape']}) | {r['flops'] / 1e12:.0f} |")
    print("| causal attention, seq (batch x 32 heads x 128) | fwd TFLOP/s | fwd+bwd TFLOP/s |")
    print("| --- | ---: | ---: |")
    for r in result["attention"]:
        print(
            f"| {r['seq']} ({r['batch']}) | {r['fwd_flops'] / 1e12:.0f} |"
            f" {r['train_flops'] / 1e12:.0f} |"
        )
    print(f"copy: {result['bandwidth']['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    ce = result["cross_entropy"]
    print(
        f"fp32 cross-entropy fwd+bwd, {ce['tokens']} x {ce['vocab']}: {ce['seconds'] * 1e3:.1f} ms"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
