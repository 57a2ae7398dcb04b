"""Speech batches for training: lhotse sampling under the seed contract of ``train.seeding``.

Two ways to read the corpus made by ``recipes/make_corpus.py``:

- a cut manifest (``cuts_train.jsonl.gz``, map-style): the sampler lives in the training
  process. Every data-parallel rank builds the same shuffled order from a seed shared by all
  of them and keeps every ``dp_size``-th batch starting at its own ``dp_rank``
  (lhotse's ``rank``/``world_size``), so data-parallel ranks read disjoint batches and ranks
  with the same ``dp_rank`` (TP peers) read the same ones. ``drop_last`` keeps the number of
  batches equal on every rank.
- a Lhotse Shar directory (``shar/train``, streaming): the sampler lives in each dataloader
  worker, as lhotse intends for Shar. Each (data-parallel rank, worker) shuffles shards and
  cuts with its own seed from ``rank_data_seed`` (lhotse's ``seed="randomized"``), so
  data-parallel ranks read differently ordered streams and TP peers identical ones; streams
  are independent rather than strictly disjoint.

A new job seed gives a new order. Within a job, ``batches_forever`` walks epoch after epoch,
each reshuffled from (job seed, epoch).
"""

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from lhotse import CutSet
from lhotse.cut import Cut
from lhotse.dataset import DynamicBucketingSampler, IterableDatasetWrapper
from lhotse.dataset.dataloading import LHOTSE_PROCESS_SEED
from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from train.seeding import rank_data_seed, sampler_seed, seed_everything

Batch = dict[str, object]
Tokenizer = Callable[[str], list[int]]


class SpeechDataset(torch.utils.data.Dataset):
    """Turns a CutSet chosen by the sampler into padded tensors.

    Returns ``features`` (B, T, 80) float32 padded with zeros, ``feature_lens`` (B,),
    ``tokens`` (B, L) int64 padded with ``pad_id``, ``token_lens`` (B,) and ``cut_ids``.
    Features are the fbank matrices precomputed in the corpus; nothing is computed per step.
    """

    def __init__(self, tokenizer_fn: Tokenizer, pad_id: int) -> None:
        self.tokenizer_fn = tokenizer_fn
        self.pad_id = pad_id

    def __getitem__(self, cuts: CutSet) -> Batch:
        features = [torch.from_numpy(cut.load_features()) for cut in cuts]
        tokens = [torch.tensor(self.tokenizer_fn(_text(cut)), dtype=torch.int64) for cut in cuts]
        return {
            "features": pad_sequence(features, batch_first=True, padding_value=0.0),
            "feature_lens": torch.tensor([f.shape[0] for f in features], dtype=torch.int64),
            "tokens": pad_sequence(tokens, batch_first=True, padding_value=self.pad_id),
            "token_lens": torch.tensor([t.shape[0] for t in tokens], dtype=torch.int64),
            "cut_ids": [cut.id for cut in cuts],
        }


def _text(cut: Cut) -> str:
    return " ".join(s.text for s in cut.supervisions)


def load_cuts(manifest: Path) -> CutSet:
    """Read a corpus cut manifest lazily; its relative paths resolve against its directory."""
    manifest = Path(manifest)
    cuts = CutSet.from_jsonl_lazy(manifest)
    return cuts.with_features_path_prefix(manifest.parent).with_recording_path_prefix(
        manifest.parent
    )


def shar_fields(shar_dir: Path) -> dict[str, list[Path]]:
    """The cut and feature shards of a Shar directory (audio shards are not read)."""
    shar_dir = Path(shar_dir)
    fields = {
        "cuts": sorted(shar_dir.glob("cuts.*.jsonl.gz")),
        "features": sorted(shar_dir.glob("features.*.tar")),
    }
    if not fields["cuts"] or len(fields["cuts"]) != len(fields["features"]):
        raise ValueError(
            f"{shar_dir} is not a Shar directory with features: expected matching "
            f"cuts.*.jsonl.gz and features.*.tar shards (make it with recipes/make_corpus.py)"
        )
    return fields


def duration_bins(cuts: Iterable[Cut], buckets: int) -> list[float]:
    """Bucket boundaries estimated from cut durations (metadata only, no features are read)."""
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    return [] if buckets == 1 else estimate_duration_buckets(cuts, num_buckets=buckets)


def init_worker(worker_id: int, *, job_seed: int, dp_rank: int, epoch: int) -> None:
    """Seed a dataloader worker from (job seed, dp rank, worker id, epoch).

    Also publishes the seed where lhotse's ``seed="randomized"`` looks for it, replacing
    lhotse's own ``worker_init_fn`` (which offsets seeds by ``100000 * rank``).
    """
    seed = rank_data_seed(job_seed, dp_rank, worker_id, epoch=epoch)
    seed_everything(seed)
    os.environ[LHOTSE_PROCESS_SEED] = str(seed)


def make_worker_init_fn(job_seed: int, dp_rank: int, epoch: int = 0) -> Callable[[int], None]:
    """A picklable ``worker_init_fn`` bound to one rank's data coordinate."""
    return functools.partial(init_worker, job_seed=job_seed, dp_rank=dp_rank, epoch=epoch)


def build_dataloader(
    cuts_path_or_shar: str | Path,
    *,
    max_duration: float,
    job_seed: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int,
    tokenizer_fn: Tokenizer,
    pad_id: int,
    shar: bool = False,
    buckets: int = 4,
    epoch: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """One epoch of batches for one data-parallel rank (see the module docstring).

    ``cuts_path_or_shar`` is a cut manifest, or a Shar directory when ``shar`` is set.
    The loader owns a torch generator seeded from the rank's data seed, so creating it
    never draws from the trainer's global RNG. ``pin_memory`` (for CUDA) lets the trainer copy
    batches to the device without blocking.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    dataset = SpeechDataset(tokenizer_fn, pad_id)
    own_seed = rank_data_seed(job_seed, dp_rank, epoch=epoch)
    common = {
        "batch_size": None,
        "num_workers": num_workers,
        "worker_init_fn": make_worker_init_fn(job_seed, dp_rank, epoch),
        "generator": torch.Generator().manual_seed(own_seed),
        "pin_memory": pin_memory,
    }
    if shar:
        fields = shar_fields(Path(cuts_path_or_shar))
        bins = duration_bins(CutSet.from_shar(fields={"cuts": fields["cuts"]}), buckets)
        # In workers, "randomized" reads the seed init_worker published; without workers,
        # the same seed as worker 0 is given directly.
        seed = "randomized" if num_workers > 0 else own_seed
        cuts = CutSet.from_shar(
            fields=fields, shuffle_shards=True, stateful_shuffle=False, seed=seed
        )
        sampler = _sampler(cuts, bins, max_duration, seed=seed, rank=0, world_size=1)
        return DataLoader(IterableDatasetWrapper(dataset, sampler), **common)
    cuts = load_cuts(Path(cuts_path_or_shar))
    sampler = _sampler(
        cuts,
        duration_bins(cuts, buckets),
        max_duration,
        seed=sampler_seed(job_seed, epoch),
        rank=dp_rank,
        world_size=dp_size,
    )
    return DataLoader(dataset, sampler=sampler, **common)


def _sampler(
    cuts: CutSet,
    bins: list[float],
    max_duration: float,
    *,
    seed: int | str,
    rank: int,
    world_size: int,
) -> DynamicBucketingSampler:
    return DynamicBucketingSampler(
        cuts,
        max_duration=max_duration,
        duration_bins=bins,
        shuffle=True,
        drop_last=True,
        seed=seed,
        rank=rank,
        world_size=world_size,
    )


def batches_forever(
    loader_for_epoch: Callable[[int], Iterable[Batch]],
) -> Iterator[tuple[int, Batch]]:
    """Yield (epoch, batch) without end, building each epoch's loader from its number.

    Typical use::

        batches = batches_forever(
            lambda epoch: build_dataloader(path, ..., job_seed=seed, epoch=epoch)
        )

    A job with a new seed starts a new order; the trainer skips the batches already consumed
    only when it resumes with the seed that produced them (train/trainer.py, data_position).
    """
    epoch = 0
    while True:
        produced = False
        for batch in loader_for_epoch(epoch):
            produced = True
            yield epoch, batch
        if not produced:
            raise ValueError(
                f"epoch {epoch} produced no batches: the data is smaller than one batch per "
                f"data-parallel rank; lower max_duration or use more data"
            )
        epoch += 1
