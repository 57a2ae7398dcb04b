"""Validation loss over a whole split, apart from training's data position and random state.

The split's cuts are sorted by (duration, id) and packed greedily into batches of at most
``max_duration`` seconds, so the batches depend on the manifest and the batch size alone: the
same at any layout, in any job. Data-parallel rank ``r`` of ``n`` takes batches ``r, r + n, ...``
(TP, CP and PP peers share its coordinate and read the same ones); every rank runs the same
number of forwards, a rank with fewer batches repeating its first one and discarding the
result, because sharded layers communicate in every forward. Nothing here draws a random
number or touches the training loader, so a run with validation trains exactly as one without.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from lhotse import CutSet
from lhotse.cut import Cut

from contract.run_dir import VAL_LOSS_PREFIX
from train.data.features import Featurizer
from train.data.loader import LoadedBatch, SpeechDataset, TextCodec
from train.loop.device_trap import trapped
from train.loop.step import WholeModelRunner
from train.metrics import MetricsLogger
from train.models.batch import Batch
from train.models.loss import loss_targets
from train.models.pipeline import PipelineRunner
from train.parallel.distributed import say
from train.parallel.mesh import Meshes


def validation_batches(cuts: Iterable[Cut], max_duration: float) -> list[CutSet]:
    """The split's batches: cuts sorted by (duration, id), each batch up to ``max_duration``
    seconds (a longer cut makes a batch of its own)."""
    ordered = sorted(cuts, key=lambda cut: (cut.duration, cut.id))
    batches: list[list] = []
    seconds = 0.0
    for cut in ordered:
        if batches and seconds + cut.duration <= max_duration:
            batches[-1].append(cut)
            seconds += cut.duration
        else:
            batches.append([cut])
            seconds = cut.duration
    return [CutSet.from_cuts(batch) for batch in batches]


def rank_share(num_batches: int, dp_rank: int, dp_size: int) -> tuple[list[int], int]:
    """This rank's batch indices and how many forwards every rank runs (the most any has)."""
    return list(range(dp_rank, num_batches, dp_size)), math.ceil(num_batches / dp_size)


class ValidationSet:
    """One data-parallel rank's share of one validation set, as (batch, counts) pairs per pass.

    Batches whose features are computed from audio (a pretrained encoder's extractor, a source
    without stored features) are kept after the first pass: the set is the same at every
    validation, so the audio is decoded and featurized once (bench/bench_features.py: 2-3 ms per
    2-s utterance on one core here, against 0.1 ms to read features back).
    """

    def __init__(
        self,
        name: str,
        cuts: Iterable[Cut],
        max_duration: float,
        dp_rank: int,
        dp_size: int,
        text: TextCodec,
        featurize: Featurizer,
    ) -> None:
        self.name = name
        batches = validation_batches(cuts, max_duration)
        if not batches:
            raise ValueError(f"validation set {name} holds no cuts")
        indices, self.forwards = rank_share(len(batches), dp_rank, dp_size)
        self.batches = [batches[index] for index in indices] or [batches[0]]
        self.has_own = bool(indices)
        self.dataset = SpeechDataset(text, featurize)
        self.keep = not featurize.extractor.uses_stored or not all(
            cut.has_features for batch in self.batches for cut in batch
        )
        self.kept: dict[int, LoadedBatch] = {}

    def __iter__(self) -> Iterator[tuple[LoadedBatch, bool]]:
        """``forwards`` batches: (batch, whether it counts); the fillers repeat the first."""
        for index in range(self.forwards):
            counts = self.has_own and index < len(self.batches)
            yield self.batch(index if counts else 0), counts

    def batch(self, index: int) -> LoadedBatch:
        if index in self.kept:
            return self.kept[index]
        batch = self.dataset[self.batches[index]]
        if self.keep:
            self.kept[index] = batch
        return batch


class Validator:
    """The loss over every validation set at the current weights, every ``eval.interval`` steps
    (not at the last: the job validates once it has saved) and at the end of a job.

    Next-token loss only, no balance loss: ``val_loss/<name>`` per set and ``val_loss`` pooled
    over all their targets, logged by rank 0.
    """

    def __init__(
        self,
        sets: list[ValidationSet],
        runner: WholeModelRunner | PipelineRunner,
        meshes: Meshes,
        pp_group: dist.ProcessGroup | None,
        interval: int,
        device: torch.device,
        device_trap: bool,
    ) -> None:
        self.sets, self.runner, self.meshes, self.pp_group = sets, runner, meshes, pp_group
        self.interval, self.device, self.device_trap = interval, device, device_trap
        self.validated_step = -1

    def due(self, step: int, last: bool) -> bool:
        return bool(self.interval) and step % self.interval == 0 and not last

    def run(self, step: int, metrics: MetricsLogger) -> None:
        """Validate at ``step`` (once per step). Collective."""
        if not self.sets or self.validated_step == step:
            return
        started = time.perf_counter()
        sums = torch.zeros((len(self.sets), 2), dtype=torch.float64, device=self.device)
        for index, validation in enumerate(self.sets):
            for batch, counts in validation:
                # The set's batch is loaded outside the trap (train/loop/device_trap.py).
                with trapped(self.device_trap):
                    nll = self.runner.loss_sum(Batch.of(batch))
                    if counts:
                        targets = float(loss_targets(batch["token_lens"], batch["target_mask"]))
                        sums[index] += torch.stack(
                            [nll.double(), nll.new_tensor(targets, dtype=torch.float64)]
                        )
        dist.all_reduce(sums, group=self.meshes.dp.get_group())
        # The loss column alone, as a tensor of its own: a column of several sets is not
        # contiguous, and a collective on such a view reduces the wrong elements.
        losses = sums[:, 0].contiguous()
        if self.meshes.dims.cp_enabled:  # each CP rank has its positions' token losses
            dist.all_reduce(losses, group=self.meshes.cp.get_group())
        if self.pp_group is not None:  # the loss is on the last stage
            dist.all_reduce(losses, group=self.pp_group)
        sums[:, 0] = losses
        per_set = sums.tolist()
        self.validated_step = step
        nll, targets = (sum(column) for column in zip(*per_set, strict=True))
        names = [validation.name for validation in self.sets]
        record: dict[str, float | int | str] = {
            "val_loss": nll / targets,
            "val_tokens": int(targets),
            "val_split": ",".join(names),
        }
        if len(names) > 1:
            for name, (set_nll, set_targets) in zip(names, per_set, strict=True):
                record[f"{VAL_LOSS_PREFIX}{name}"] = set_nll / set_targets
        metrics.log(step, record)
        each = ", ".join(
            f"{name} {set_nll / set_targets:.4f}"
            for name, (set_nll, set_targets) in zip(names, per_set, strict=True)
        )
        say(
            f"validation at step {step}: val_loss {nll / targets:.4f} over {int(targets)} "
            f"targets ({each}; {time.perf_counter() - started:.1f} s)"
        )
