"""The training step with the encoder on every segment of a batch against the step with it on
the segments that hold audio alone (``train.models.packing.audio_rows``), on real batches.

    python -m bench.bench_encoder_rows --data data/conversations/input_cfg.yaml --preset small

The batches are the trainer's own (``train.data.loader.build_dataloader``: the mixture's
sources, sampler and collation, the byte tokenizer of the presets), the model a preset built as
the trainer builds it, on this machine's CPU in fp32, one process. Each batch's forward and
backward is timed both ways, alternating, after ``--warmup`` batches; printed: the step time
of each (median over batches), their ratio (the baseline: every segment encoded), and the
share of the encoder's segments that held no audio.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

from bench.bench_batch_balance import source_of
from train.data.loader import build_dataloader
from train.data.text import ByteTokenizer
from train.models.batch import Batch
from train.models.build import build_model
from train.models.packing import audio_rows
from train.models.presets import get_preset


def timed_step(model, batch: Batch, rows) -> float:
    """Seconds of one forward and backward."""
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    model(batch, audio_rows=rows).nll_sum.backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a manifest or an input_cfg")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--max-duration", type=float, default=30.0, help="data.max_duration")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = source_of(args.data, args.max_duration)
    loader = build_dataloader(
        data,
        max_duration=args.max_duration,
        job_seed=1,
        dp_rank=0,
        dp_size=1,
        num_workers=0,
        text=ByteTokenizer(),
    )
    model = build_model(get_preset(args.preset), torch.device("cpu"), init_seed=1)
    padded, held, empty, segments = [], [], 0, 0
    wanted = args.warmup + args.batches
    for index, loaded in enumerate(itertools.islice(loader, wanted)):
        batch = Batch.of(loaded)
        rows = audio_rows(batch.feature_lens)
        segments += batch.feature_lens.numel()
        empty += int((batch.feature_lens == 0).sum())
        every, only = timed_step(model, batch, None), timed_step(model, batch, rows)
        if index >= args.warmup:
            padded.append(every)
            held.append(only)
        print(f"batch {index}: {every:.3f} s every segment, {only:.3f} s with audio", flush=True)
    every, only = statistics.median(padded), statistics.median(held)
    print(
        f"\n{args.data}, preset {args.preset}, {len(padded)} batches of {args.max_duration:g} s: "
        f"median step {every:.3f} s encoding every segment, {only:.3f} s encoding those with "
        f"audio: {only / every:.2f}x; {empty / segments:.1%} of segments held no audio"
    )


if __name__ == "__main__":
    main()
