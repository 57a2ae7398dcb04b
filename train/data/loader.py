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

Resuming (``DataPosition``, ``batches_from``): a job resumed with the same seed continues the
stream exactly where the checkpoint left it, without loading a batch it skips. A rank's data
comes from one or more *streams*, each a lhotse sampler: one for a manifest (the sampler lives
in the training process) or for Shar without workers, one per dataloader worker for Shar. The
position is the epoch, the number of batches the trainer has taken from each stream in that
epoch, and which stream the loader asks next. It is counted where batches are consumed, not
read from the samplers: a manifest's sampler runs ahead of the trainer by the loader's prefetch,
and Shar samplers live in worker processes.
``batches_from`` reads each epoch's loader one batch ahead, so the last batch of an epoch is saved
as the start of the next epoch and a job resumed there has nothing to skip.

To resume, each stream's sampler is given lhotse's own state for that count
(``load_state_dict``). lhotse 1.33 restores a ``DynamicBucketingSampler`` by re-drawing that
many batches from the cut metadata: no features are loaded or decoded and no batch is collated
(the old way, dropping whole batches from the loader, did all of that); what remains grows with
the position: about 0.25 s of CPU for 900 batches of a 4,700-cut epoch here. Shar streams also
read their cuts' feature bytes from the tar shards while re-drawing. Shar workers take turns in a
fixed cycle and torch's loader asks worker 0 first, so on resuming the workers before the one
whose turn it was yield an empty placeholder first, which lines the turns up again.

Limits: the position is exact for the same data layout (corpus, ``max_duration``, buckets,
data-parallel size, and for Shar ``num_workers``); a job resumed under another layout is refused,
or starts the next epoch, or applies the counts as they are, as ``data.on_layout_change`` says
(``train.data.layout``).
A checkpoint without per-stream counts (written before they existed) resumes a single stream by
its batch count, and Shar with several workers by reading and dropping that many batches.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from lhotse import CutSet
from lhotse.cut import Cut
from lhotse.dataset import DynamicBucketingSampler
from lhotse.dataset.dataloading import LHOTSE_PROCESS_SEED
from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from train.config import BUFFER_SIZE
from train.data.balance import Balance, BalancedSampler
from train.data.conversation import Turn, conversation_of
from train.data.features import BadCut, Extractor, Featurizer
from train.data.prompt import Encoded
from train.data.source_cuts import SourceCheck, mixed_stream, source_of, tags_of, transcript
from train.data.storage import StorageError, shar_shards
from train.loop.garbage import worker_start
from train.seeding import mixture_seed, rank_data_seed, sampler_seed, seed_everything

# A batch as the loader gives it: the model's tensors by name (train.models.batch.Batch reads
# them) and what the trainer counts (cut_ids, sources, skipped).
LoadedBatch = dict[str, object]
T = TypeVar("T")
BIN_SAMPLE = 2000  # cuts of the mixture the duration buckets are estimated from
# Batches per rank in an epoch of a mixture (MixtureEpoch): what a resumed job re-draws at most.
MIXTURE_EPOCH_BATCHES = 5000
STREAM_KEY = "stream"  # set on Shar batches: the stream (worker's sampler) that drew the batch


@dataclass(frozen=True)
class DataPosition:
    """Where one data-parallel rank is in its data: batches taken from each stream in ``epoch``,
    and the stream the loader asks next (see the module docstring)."""

    epoch: int
    streams: tuple[int, ...]
    next_stream: int = 0

    @classmethod
    def start(cls, num_streams: int, epoch: int = 0) -> DataPosition:
        return cls(epoch, (0,) * num_streams)

    @classmethod
    def resume(cls, saved: dict, num_streams: int) -> tuple[DataPosition, int]:
        """The position a saved ``state()`` resumes at, and how many batches must be read and
        dropped first: none, unless the save has no per-stream counts for several streams."""
        epoch, taken = int(saved.get("epoch", 0)), int(saved.get("batch_in_epoch", 0))
        streams = tuple(int(n) for n in saved.get("streams", ()))
        if len(streams) == num_streams:
            return cls(epoch, streams, int(saved.get("next_stream", 0))), 0
        if num_streams == 1:
            return cls(epoch, (taken,)), 0
        return cls.start(num_streams, epoch), taken

    @property
    def batch_in_epoch(self) -> int:
        return sum(self.streams)

    def after(self, epoch: int, stream: int) -> DataPosition:
        """The position once a batch of ``epoch`` drawn by ``stream`` is taken."""
        streams = list(self.streams) if epoch == self.epoch else [0] * len(self.streams)
        streams[stream] += 1
        return DataPosition(epoch, tuple(streams), (stream + 1) % len(streams))

    def state(self) -> dict:
        """JSON for the checkpoint's trainer state."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "streams": list(self.streams),
            "next_stream": self.next_stream,
        }


class TextCodec(Protocol):
    """What a batch needs of the text side (``train.data.text``): examples, per-cut prompt,
    padding."""

    pad_id: int

    def for_tags(self, tags: Mapping[str, Any]) -> TextCodec: ...

    def example(self, text: str) -> Encoded: ...

    def conversation(self, turns: Sequence[Turn]) -> Encoded: ...


class SpeechDataset(torch.utils.data.Dataset):
    """Turns a CutSet chosen by the sampler into padded tensors, in a dataloader worker.

    Returns ``features`` (B, K, T, bins) float32, each example's audio segments (a speech cut's
    one, a conversation's audio turns, none for text only) padded with zeros to the batch's
    most segments and frames, ``feature_lens`` (B, K) (0: no segment), ``tokens`` (B, L) int64
    padded with ``pad_id``, ``token_lens`` (B,), before which token each segment goes
    (``audio_at``, B x K) and which tokens the loss covers (``target_mask``, B x L),
    ``cut_ids``, each cut's ``sources`` name, and one line for each ``skipped`` cut (cut,
    reason, source).

    Features come from ``featurize`` (``train.data.features``): the corpus's stored fbank, or
    computed here from the audio for a pretrained encoder or a source without features. A cut
    whose audio or text turns out unusable (a corrupt file, a special token in its transcript)
    is left out of its batch and reported in ``skipped``; a batch with no usable cut at all
    stops the job with the reasons.
    """

    def __init__(self, text: TextCodec, featurize: Featurizer | None = None) -> None:
        self.text = text
        self.featurize = featurize or Featurizer(Extractor())

    def __getitem__(self, cuts: CutSet) -> LoadedBatch:
        features, examples, kept, skipped = [], [], [], []
        for cut in cuts:
            try:
                example = encoded(self.text, cut)
                found = self.featurize.segments(cut)
            except ValueError as error:  # BadCut, or a text the codec refuses
                why = str(error) if isinstance(error, BadCut) else f"cut {cut.id}: {error}"
                skipped.append(f"{why} (source {source_of(cut) or '-'})")
                continue
            features.append([torch.from_numpy(f) for f in found])
            examples.append(example)
            kept.append(cut)
        if not kept:
            reasons = "; ".join(skipped[:3])
            raise BadCut(f"every cut of a batch is unusable: {reasons}")
        padded, lens = pad_segments(features, self.featurize.bins)
        tokens = [
            torch.tensor(example.tokens, dtype=torch.int64, device="cpu") for example in examples
        ]
        return {
            "features": padded,
            "feature_lens": lens,
            "tokens": pad_sequence(tokens, batch_first=True, padding_value=self.text.pad_id),
            "token_lens": torch.tensor(
                [t.shape[0] for t in tokens], dtype=torch.int64, device="cpu"
            ),
            "audio_at": audio_at_rows(examples, padded.shape[1]),
            "target_mask": pad_sequence(
                [torch.tensor(e.target_mask(), dtype=torch.bool, device="cpu") for e in examples],
                batch_first=True,
            ),
            "cut_ids": [cut.id for cut in kept],
            "sources": [source_of(cut) for cut in kept],
            "skipped": skipped,
        }


def encoded(text: TextCodec, cut: Cut) -> Encoded:
    """A cut as its tokens: a conversation rendered whole, a speech cut's transcript as the
    answer of its source's prompt."""
    codec, turns = text.for_tags(tags_of(cut)), conversation_of(cut.custom)
    return codec.example(transcript(cut)) if turns is None else codec.conversation(turns)


def pad_segments(
    features: list[list[torch.Tensor]], bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's segments (frames, bins) as one (B, K, T, bins) tensor, zero-padded to the
    most segments (at least one) and frames, and their lengths (B, K), 0 where none."""
    segments = max(1, *(len(found) for found in features))
    frames = max((f.shape[0] for found in features for f in found), default=0)
    padded = torch.zeros((len(features), segments, frames, bins), dtype=torch.float32, device="cpu")
    lens = torch.zeros((len(features), segments), dtype=torch.int64, device="cpu")
    for row, found in enumerate(features):
        for index, segment in enumerate(found):
            padded[row, index, : segment.shape[0]] = segment
            lens[row, index] = segment.shape[0]
    return padded, lens


def audio_at_rows(examples: list[Encoded], segments: int) -> torch.Tensor:
    """Before which token each example's audio segments go (B, segments), 0 past its own."""
    rows = [list(e.audio_at) + [0] * (segments - len(e.audio_at)) for e in examples]
    return torch.tensor(rows, dtype=torch.int64, device="cpu")


def load_cuts(manifest: Path) -> CutSet:
    """Read a corpus cut manifest lazily; its relative paths resolve against its directory."""
    manifest = Path(manifest)
    cuts = CutSet.from_jsonl_lazy(manifest)
    return cuts.with_features_path_prefix(manifest.parent).with_recording_path_prefix(
        manifest.parent
    )


def shar_fields(shar_dir: Path) -> dict[str, list[Path | str]]:
    """The cut and feature shards of a Shar directory (audio shards are not read)."""
    try:
        shards = shar_shards(Path(shar_dir))
    except (StorageError, OSError):
        shards = {}
    if "features" not in shards:
        raise ValueError(
            f"{shar_dir} is not a Shar directory with features: expected matching "
            f"cuts.*.jsonl.gz and features.*.tar shards (make it with recipes/make_corpus.py)"
        )
    return {"cuts": shards["cuts"], "features": shards["features"]}


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
    worker_start()  # the rank's collector was paused (train/loop/garbage.py)
    seed = rank_data_seed(job_seed, dp_rank, worker_id, epoch=epoch)
    seed_everything(seed)
    os.environ[LHOTSE_PROCESS_SEED] = str(seed)


def make_worker_init_fn(job_seed: int, dp_rank: int, epoch: int = 0) -> Callable[[int], None]:
    """A picklable ``worker_init_fn`` bound to one rank's data coordinate."""
    return functools.partial(init_worker, job_seed=job_seed, dp_rank=dp_rank, epoch=epoch)


def fast_forward(sampler: DynamicBucketingSampler, batches: int) -> None:
    """Make ``sampler``'s next iteration continue after its first ``batches`` batches.

    Goes through lhotse's own resume (``load_state_dict``), which re-draws those batches from
    the cut metadata without loading features. Past the end of the epoch, the sampler is left
    at its end.
    """
    if batches == 0:
        return
    state = sampler.state_dict()
    diagnostics = state["diagnostics"]
    diagnostics["stats_per_epoch"][diagnostics["current_epoch"]].update(
        kept_batches=batches, discarded_batches=0
    )
    try:
        sampler.load_state_dict(state)
    except StopIteration:  # fewer batches in the epoch (another layout): stop at its end
        fast_forward(sampler, sampler.diagnostics.current_epoch_stats.kept_batches)


class SharStream(torch.utils.data.IterableDataset):
    """Batches of one Shar stream per dataloader worker (or of one stream without workers),
    each tagged with its stream; ``position`` resumes every stream where it was.

    The loader asks its workers in turn, worker 0 first. When resuming, the workers before the
    stream whose turn it is first yield an empty placeholder (``batches_from`` drops it), so
    the turns line up with the saved ones.
    """

    def __init__(
        self,
        dataset: SpeechDataset,
        sampler: DynamicBucketingSampler,
        position: DataPosition | None,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.position = position

    def __iter__(self) -> Iterator[LoadedBatch]:
        info = torch.utils.data.get_worker_info()
        stream = 0 if info is None else info.id
        if self.position is not None:
            fast_forward(self.sampler, self.position.streams[stream])
            if stream < self.position.next_stream:
                yield {}
        for cuts in self.sampler:
            yield {**self.dataset[cuts], STREAM_KEY: stream}


def build_dataloader(
    data: str | Path | list[SourceCheck],
    *,
    max_duration: float,
    job_seed: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int,
    text: TextCodec,
    featurize: Featurizer | None = None,
    shar: bool = False,
    buckets: int = 4,
    buffer_size: int = BUFFER_SIZE,
    epoch: int = 0,
    position: DataPosition | None = None,
    pin_memory: bool = False,
    mixture_epoch_batches: int = MIXTURE_EPOCH_BATCHES,
    balance: Balance | None = None,
) -> DataLoader | MixtureEpoch:
    """One epoch of batches for one data-parallel rank (see the module docstring).

    ``data`` is a cut manifest, a Shar directory when ``shar`` is set, or the checked sources
    of ``data.input_cfg``: mixed by weight (``train.data.source_cuts.mixed_stream``, seeded per
    epoch), an endless stream cut into epochs of ``mixture_epoch_batches`` batches per rank,
    resumed like a manifest's by re-drawing the batches ``position`` counts. ``position`` (of
    this epoch) continues the epoch after the batches it counts; Shar batches then carry
    ``STREAM_KEY``. The loader owns a torch generator seeded from the rank's
    data seed, so creating it never draws from the trainer's global RNG. ``pin_memory`` (for
    CUDA) lets the trainer copy batches to the device without blocking. Features are computed
    by ``featurize`` in the loader's workers when the cuts carry audio only. ``balance`` deals
    each step's examples to the ranks by cost (``train.data.balance``; not for Shar, whose
    ranks draw their own streams).
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    if position is not None and position.epoch != epoch:
        raise ValueError(f"position is in epoch {position.epoch}, the loader reads {epoch}")
    dataset = SpeechDataset(text, featurize)
    own_seed = rank_data_seed(job_seed, dp_rank, epoch=epoch)
    common = {
        "batch_size": None,
        "num_workers": num_workers,
        "worker_init_fn": make_worker_init_fn(job_seed, dp_rank, epoch),
        "generator": torch.Generator().manual_seed(own_seed),
        "pin_memory": pin_memory,
    }
    if shar:
        fields = shar_fields(Path(data))
        bins = duration_bins(CutSet.from_shar(fields={"cuts": fields["cuts"]}), buckets)
        # In workers, "randomized" reads the seed init_worker published; without workers,
        # the same seed as worker 0 is given directly.
        seed = "randomized" if num_workers > 0 else own_seed
        cuts = CutSet.from_shar(
            fields=fields, shuffle_shards=True, stateful_shuffle=False, seed=seed
        )
        sampler = _sampler(cuts, bins, max_duration, buffer_size, seed=seed, rank=0, world_size=1)
        return DataLoader(SharStream(dataset, sampler, position), **common)
    sampler = rank_sampler(
        data, max_duration, job_seed, dp_rank, dp_size, buckets, buffer_size, epoch, balance
    )
    taken = 0 if position is None else position.streams[0]
    if taken:
        fast_forward(sampler, taken)
    loader = DataLoader(dataset, sampler=sampler, **common)
    if isinstance(data, list):
        return MixtureEpoch(loader, mixture_epoch_batches - taken)
    return loader


class MixtureEpoch:
    """The first ``batches`` batches of an endless mixture's loader: an epoch of the mixture.

    The mixture itself never ends; cutting it into epochs (each with seeds of its own) bounds
    what a resumed job re-draws from the cut metadata to one epoch's batches, however long the
    run has been going.
    """

    def __init__(self, loader: DataLoader, batches: int) -> None:
        self.loader, self.batches = loader, batches

    def __iter__(self) -> Iterator[LoadedBatch]:
        return itertools.islice(self.loader, max(self.batches, 0))


def rank_sampler(
    data: str | Path | list[SourceCheck],
    max_duration: float,
    job_seed: int,
    dp_rank: int,
    dp_size: int,
    buckets: int,
    buffer_size: int = BUFFER_SIZE,
    epoch: int = 0,
    balance: Balance | None = None,
) -> DynamicBucketingSampler:
    """The sampler of ``dp_rank``'s batches of a manifest or of checked sources in ``epoch``,
    as ``build_dataloader`` reads them: its batches are CutSets, nothing loaded. With
    ``balance``, each step's examples are dealt to the ranks by cost (``train.data.balance``)."""
    if isinstance(data, list):
        cuts = mixed_stream(data, mixture_seed(job_seed, epoch))
        durations = mixed_stream(data, mixture_seed(job_seed, epoch), durations_only=True)
        bins = duration_bins(durations.subset(first=BIN_SAMPLE), buckets)
    else:
        cuts = load_cuts(Path(data))
        bins = duration_bins(cuts, buckets)
    return _sampler(
        cuts,
        bins,
        max_duration,
        buffer_size,
        seed=sampler_seed(job_seed, epoch),
        rank=dp_rank,
        world_size=dp_size,
        balance=balance,
    )


def _sampler(
    cuts: CutSet,
    bins: list[float],
    max_duration: float,
    buffer_size: int,
    *,
    seed: int | str,
    rank: int,
    world_size: int,
    balance: Balance | None = None,
) -> DynamicBucketingSampler:
    settings = {
        "max_duration": max_duration,
        "duration_bins": bins,
        "buffer_size": buffer_size,
        "shuffle": True,
        "drop_last": True,
        "seed": seed,
        "rank": rank,
        "world_size": world_size,
    }
    if balance is None:
        return DynamicBucketingSampler(cuts, **settings)
    return BalancedSampler(cuts, cost=balance.cost, window=balance.window, **settings)


def batches_forever(
    loader_for_epoch: Callable[[int], Iterable[T]],
    first_epoch: int = 0,
    *,
    resumed: bool = False,
) -> Iterator[tuple[int, T]]:
    """Yield (epoch, batch) without end, building each epoch's loader from its number.

    Typical use::

        batches = batches_forever(
            lambda epoch: build_dataloader(path, ..., job_seed=seed, epoch=epoch)
        )

    ``resumed``: the first epoch continues where a previous job stopped, so it may have no
    batch left.
    """
    epoch = first_epoch
    while True:
        produced = resumed and epoch == first_epoch
        for batch in loader_for_epoch(epoch):
            produced = True
            yield epoch, batch
        if not produced:
            raise ValueError(
                f"epoch {epoch} produced no batches: the data is smaller than one batch per "
                f"data-parallel rank; lower max_duration or use more data"
            )
        epoch += 1


def _marking_last(batches: Iterable[LoadedBatch]) -> Iterator[tuple[LoadedBatch, bool]]:
    """Each batch of one epoch's loader with whether it is the epoch's last (known by reading
    one batch ahead); SharStream's placeholders are dropped."""
    pending = None
    for batch in batches:
        if not batch:
            continue
        if pending is not None:
            yield pending, False
        pending = batch
    if pending is not None:
        yield pending, True


def batches_from(
    loader_for: Callable[[int, DataPosition | None], Iterable[LoadedBatch]],
    start: DataPosition,
    replay: int = 0,
) -> Iterator[tuple[DataPosition, LoadedBatch]]:
    """Yield (position after the batch, batch) without end, from ``start`` on.

    ``loader_for(epoch, position)`` builds an epoch's loader (``build_dataloader``), resumed at
    ``position`` or from the epoch's start (None). The samplers of ``start.epoch`` continue
    where they were; ``replay`` batches are read from the epoch's start and dropped first (the
    fallback for checkpoints without per-stream counts, see ``DataPosition.resume``).

    The last batch of an epoch comes with the start of the next epoch as its position, so a job
    resumed there does not walk the finished epoch's samplers.
    """
    resume_at = start if start.batch_in_epoch and not replay else None

    def loader(epoch: int) -> Iterable[tuple[LoadedBatch, bool]]:
        return _marking_last(loader_for(epoch, resume_at if epoch == start.epoch else None))

    position = start
    items = batches_forever(loader, start.epoch, resumed=resume_at is not None)
    for epoch, (batch, last) in items:
        position = position.after(epoch, int(batch.pop(STREAM_KEY, 0)))
        if replay and epoch == start.epoch:
            replay -= 1
            continue
        yield (DataPosition.start(len(position.streams), epoch + 1) if last else position), batch
