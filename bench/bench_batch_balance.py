"""How evenly the sampler deals work to data-parallel ranks, and how much of the encoder's input
is padding, from real batches on the CPU.

    python -m bench.bench_batch_balance --data data/corpus_asr/cuts_train.jsonl.gz
    python -m bench.bench_batch_balance --data data/mix/input_cfg.yaml --ranks 8 64 --steps 40
    python -m bench.bench_batch_balance --data data/conversations/input_cfg.yaml --window 1

``--window N`` deals each N steps' examples by FLOPs (``train.data.balance``, the trainer's
``data.balance=flops``, ``data.balance_window=N``); without it, batches are as lhotse draws them.

The sampler is built as the trainer builds it (``train.data.loader.rank_sampler``: the same seeds,
buckets and batch budget). lhotse's sampler of every rank draws the batches of all ranks of a
step and keeps its own (``CutSampler.__next__``), so one sampler's draws are every rank's
batches (``step_batches``): 64 ranks cost one sampler, not 64. The first ``--steps`` steps are
read as cut lists, nothing loaded: an example's audio segments (a speech cut's audio, a
conversation's audio turns) as lhotse's fbank frames of their durations (10 ms hop), its tokens
as the byte tokenizer renders it (the presets' codec). Per step:

- **busiest / mean**: the training FLOPs (forward + backward) of each rank's batch by
  ``train.flops.sequence_flops`` (encoder with its attention, projector, decoder with its
  attention) at ``--preset``'s shape; the step waits for the busiest rank, so
  ``busiest / mean - 1`` is the share of the step the others idle;
- **encoder padding**: the frames the encoder runs on as the batch pads them
  (``train.data.loader.pad_segments``: examples x most segments x longest segment) that hold no
  audio; **without empty segments**: the same once the segments without audio are left out, as
  the training step encodes them (``train.models.packing.audio_rows``), still padded to the
  longest (the step then packs them: ``train.models.frame_packing``, which this leaves out).

Printed per data set and rank count: the mean and worst busiest/mean over the steps, and the
padding share over all batches of all ranks.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from train.data.balance import Balance
from train.data.features import FBANK_HOP_S, AudioLimits
from train.data.loader import rank_sampler
from train.data.source_cuts import check_sources
from train.data.sources import read_sources
from train.data.text import ByteTokenizer
from train.data.work import example_flops, example_frames, flops_cost
from train.models.presets import get_preset
from train.models.shape import SALMConfig

REPO = Path(__file__).resolve().parents[1]

SAMPLING_RATE = 16000


def batch_work(cfg: SALMConfig, cuts, text) -> tuple[float, int, int, int]:
    """One batch's training FLOPs, and its encoder's real input frames, padded ones, and
    padded ones once the segments without audio are left out (``train.models.packing.
    audio_rows``: at least one row)."""
    flops = sum(example_flops(cfg, text, FBANK_HOP_S, SAMPLING_RATE, cuts))
    frames = example_frames(cuts, FBANK_HOP_S, SAMPLING_RATE)
    longest = int(frames.max())
    held = max(1, int((frames > 0).sum()))
    return flops, int(frames.sum()), frames.numel() * longest, held * longest


def step_batches(sampler) -> list:
    """The batches of every rank for the sampler's next step, in rank order: what each rank's
    own sampler draws before it keeps ``batches[rank]`` (lhotse's ``CutSampler.__next__``).
    StopIteration once a rank would have none (the end of the epoch, where lhotse deals the
    rest out again)."""
    return [sampler._next_batch() for _ in range(sampler.world_size)]


def measure(data, cfg: SALMConfig, ranks: int, steps: int, args) -> dict[str, float]:
    text = ByteTokenizer()
    balance = None
    if args.window:
        balance = Balance(flops_cost(cfg, text, FBANK_HOP_S, SAMPLING_RATE), args.window)
    sampler = rank_sampler(
        data, args.max_duration, args.seed, 0, ranks, args.buckets, balance=balance
    )
    iter(sampler)
    ratios, real, padded, held = [], 0, 0, 0
    for _ in range(steps):
        try:
            batches = step_batches(sampler)
        except StopIteration:  # a small data set's epoch dealt out
            break
        work = [batch_work(cfg, cuts, text) for cuts in batches]
        flops = [w[0] for w in work]
        ratios.append(max(flops) / statistics.fmean(flops))
        real += sum(w[1] for w in work)
        padded += sum(w[2] for w in work)
        held += sum(w[3] for w in work)
    return {
        "steps": len(ratios),
        "mean": statistics.fmean(ratios),
        "worst": max(ratios),
        "padding": 1 - real / padded if padded else 0.0,
        "held": 1 - real / held if held else 0.0,
    }


def source_of(path: Path, max_duration: float):
    """A manifest as it is, or an input_cfg's sources checked as the trainer checks them."""
    if path.name.endswith((".jsonl.gz", ".jsonl")):
        return path
    sources = read_sources(path, "data.input_cfg")
    return check_sources(sources, max_duration, AudioLimits(SAMPLING_RATE), lambda _line: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data", type=Path, nargs="+", required=True, help="manifests or input_cfgs"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--preset", default="llm_1b")
    parser.add_argument("--max-duration", type=float, default=60.0, help="data.max_duration")
    parser.add_argument("--buckets", type=int, default=4, help="data.buckets")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--window",
        type=int,
        default=0,
        help="deal each WINDOW steps' examples by FLOPs (train.data.balance); 0: as drawn",
    )
    args = parser.parse_args()
    cfg = get_preset(args.preset)
    dealt = f"dealt by FLOPs over {args.window} steps" if args.window else "dealt as drawn"
    print(f"{args.preset}, data.max_duration={args.max_duration}, data.buckets={args.buckets}, ")
    print(dealt)
    print(f"up to {args.steps} steps from the first\n")
    print(
        "| data | ranks | steps | busiest / mean (mean) | worst step | encoder padding "
        "| without empty segments |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in args.data:
        data = source_of(path, args.max_duration)
        for ranks in args.ranks:
            got = measure(data, cfg, ranks, args.steps, args)
            print(
                f"| {path} | {ranks} | {got['steps']} | {got['mean']:.3f} | {got['worst']:.3f} "
                f"| {got['padding']:.1%} | {got['held']:.1%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
