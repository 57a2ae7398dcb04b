"""The training step with the encoder on every segment of a batch, padded, against the step
with it on the segments that hold audio alone (``train.models.packing.audio_rows``), padded,
and on those packed into one sequence (``train.models.frame_packing``), on real batches.

    python -m bench.bench_encoder_packing --data data/conversations/input_cfg.yaml --preset small
    python -m bench.bench_encoder_packing --data ... --encoder data/pretrained/whisper-tiny.en

The batches are the trainer's own (``train.data.loader.build_dataloader``: the mixture's
sources, sampler and collation, the byte tokenizer of the presets), the model a preset built as
the trainer builds it (with ``--encoder``, that pretrained encoder's shape, random weights),
on this machine's CPU in fp32, one process. Each batch's forward and
backward is timed the three ways in turn, after ``--warmup`` batches; printed: the step time of
each (median over batches), its ratio to the baseline (every segment encoded, padded), the
share of segments that held no audio and the share of the rows' encoder frames that were
length padding (``train.models.frame_packing.padding_share``).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

from bench.bench_batch_balance import source_of
from train.config import ModelConfig
from train.data.loader import build_dataloader
from train.data.text import ByteTokenizer
from train.models.batch import Batch
from train.models.build import build_model
from train.models.frame_packing import EncoderPlan, encoder_plan, padding_share
from train.parallel.layout import model_of

WAYS = ("every segment, padded", "segments with audio, padded", "segments with audio, packed")


def timed_step(model, batch: Batch, plan: EncoderPlan | None) -> float:
    """Seconds of one forward and backward."""
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    model(batch, encoder_plan=plan).nll_sum.backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a manifest or an input_cfg")
    parser.add_argument("--preset", default="small")
    parser.add_argument(
        "--encoder", help="a pretrained encoder's directory (model.pretrained_encoder)"
    )
    parser.add_argument("--max-duration", type=float, default=30.0, help="data.max_duration")
    parser.add_argument("--buckets", type=int, default=4, help="data.buckets")
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
        buckets=args.buckets,
    )
    shape = ModelConfig(preset=args.preset, pretrained_encoder=args.encoder)
    model = build_model(model_of(shape), torch.device("cpu"), init_seed=1)
    times: list[list[float]] = [[] for _ in WAYS]
    empty = segments = 0
    padding = []
    for index, loaded in enumerate(itertools.islice(loader, args.warmup + args.batches)):
        batch = Batch.of(loaded)
        packed = encoder_plan(model.cfg, model.encoder, batch.feature_lens)
        plans = (None, EncoderPlan(packed.rows, None), packed)
        taken = [timed_step(model, batch, plan) for plan in plans]
        segments += batch.feature_lens.numel()
        empty += int((batch.feature_lens == 0).sum())
        padding.append(padding_share(model.cfg, batch.feature_lens))
        if index >= args.warmup:
            for way, seconds in zip(times, taken, strict=True):
                way.append(seconds)
        print(f"batch {index}: " + ", ".join(f"{s:.3f} s" for s in taken), flush=True)
    medians = [statistics.median(way) for way in times]
    print(
        f"\n{args.data}, preset {args.preset}, encoder {args.encoder or 'own'}, "
        f"{len(times[0])} batches of {args.max_duration:g} s, {args.buckets} buckets: "
        f"{empty / segments:.1%} of segments held no audio, "
        f"{statistics.mean(padding):.1%} of the frames of those with audio were padding"
    )
    for name, median in zip(WAYS, medians, strict=True):
        print(f"  {name:<30} median step {median:.3f} s  {median / medians[0]:.2f}x")


if __name__ == "__main__":
    main()
