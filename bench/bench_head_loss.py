"""The loss's peak memory: the chunked head loss against the full logits' loss it replaced.

    python -m bench.bench_head_loss                    # vocab 128,256, 16K positions, bf16
    python -m bench.bench_head_loss --positions 4096 --dtype float32 --chunks 256 1024

Each loss runs forward and backward once on fake tensors (``FakeTensorMode``: shapes and
dtypes, no storage, so 16K positions of a 128K vocabulary need no 30 GiB of host memory) under
PyTorch's ``MemTracker``; the peak counts what the loss allocates beyond its inputs: the
logits, their fp32 cast and log-probabilities and their gradients for the full loss, one
chunk's logits and the head's fp32 gradient sum for the chunked one. The baseline is the
trainer's loss before the chunks: ``F.cross_entropy`` over ``F.linear``'s logits cast to fp32
(what torchtitan compiles instead, fusing some of its passes, is not measured here).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from train.models.head_loss import head_loss
from train.models.packing import IGNORE_INDEX
from train.parallel.dims import DEFAULT_LOSS_CHUNK

REPO = Path(__file__).resolve().parents[1]

GIB = 2**30


def full_logits_loss(hidden, weight, labels):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def peak_gib(loss_fn, positions: int, width: int, vocab: int, dtype: torch.dtype) -> float:
    with FakeTensorMode():
        hidden = torch.empty(positions, width, dtype=dtype, requires_grad=True)
        weight = torch.empty(vocab, width, dtype=dtype, requires_grad=True)
        labels = torch.zeros(positions, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(hidden, weight)
        with tracker:
            loss_fn(hidden, weight, labels).backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    # What the loss adds: its activations and temporaries, and the two gradients it returns.
    return sum(peak[kind] for kind in peak if kind != "Total" and kind.name != "PARAM") / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=16384)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--chunks", type=int, nargs="+", default=[DEFAULT_LOSS_CHUNK, 4096])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shape = (args.positions, args.width, args.vocab, dtype)
    full = peak_gib(full_logits_loss, *shape)
    print(f"loss peak, {args.positions} positions x vocab {args.vocab}, width {args.width}, ")
    print(f"{args.dtype} (fake tensors, MemTracker)\n")
    print("| loss | peak GiB | vs full logits |")
    print("|---|---|---|")
    print(f"| full logits (F.linear + F.cross_entropy, fp32 cast) | {full:.2f} | 1.00x |")
    for chunk in args.chunks:
        got = peak_gib(lambda h, w, y, c=chunk: head_loss(h, w, y, c), *shape)
        print(f"| chunked, {chunk} positions | {got:.2f} | {got / full:.2f}x |")


if __name__ == "__main__":
    main()
