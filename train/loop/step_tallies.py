"""A step's figures kept on the device, read back to the host once per sync step, by name.

Every step queues its kernels without waiting for the device: its loss sums, gradient norm and
counts are accumulated in device tensors, and only a sync step (``train.sync_every``, each log
line, each save) reduces them over the ranks and copies them to the host in one read. The
counts of a step's global batch are computed from the batches' CPU length tensors before the
forward, so the loss is normalised by them with no host sync either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from train.data.loader import LoadedBatch
from train.flops import sequence_flops
from train.models.loss import loss_targets
from train.models.packing import example_positions
from train.models.shape import SALMConfig
from train.parallel.mesh import Meshes

COUNTS = ("targets", "positions", "flops", "sequences")  # `global_counts`, in this order


class Synced(NamedTuple):
    """What a sync step reads back: the last step's figures, the tallies since the previous
    sync, and the stop flag the ranks agreed on (the MAX of theirs)."""

    nll: float  # the last step's next-token loss sum over all ranks
    aux: float  # its weighted balance-loss sum
    targets: float  # its global loss targets
    sequences: float  # its global sequences
    grad_norm: float  # its global gradient norm, before clipping
    new_targets: float  # loss targets of the steps since the previous sync
    positions: float  # their decoder positions
    flops: float  # their model FLOPs
    new_sequences: float  # their sequences
    nonfinite_run: float  # consecutive skipped steps up to the last
    new_nonfinite: float  # steps skipped since the previous sync
    stop_flag: float

    @property
    def loss(self) -> float:
        """The last step's loss as it was minimized: per target, plus balance per sequence."""
        return self.nll / self.targets + self.aux / self.sequences


def global_counts(
    batches: Sequence[LoadedBatch], cfg: SALMConfig, device: torch.device, meshes: Meshes
) -> torch.Tensor:
    """``COUNTS`` of the step's global batch (all its microbatches, all data-parallel ranks),
    on the device: tensor arithmetic on the CPU length tensors (no value read into Python),
    then one all-reduce over the data-parallel ranks on the device."""
    local = torch.zeros(len(COUNTS), dtype=torch.float64, device="cpu")
    for batch in batches:
        feature_lens, token_lens = batch["feature_lens"].double(), batch["token_lens"].double()
        local += torch.stack(
            [
                loss_targets(token_lens, batch["target_mask"].double()),
                (example_positions(cfg, feature_lens) + token_lens).sum(),
                sequence_flops(cfg, feature_lens, token_lens).sum(),
                torch.tensor(float(len(token_lens)), dtype=torch.float64, device="cpu"),
            ]
        )
    if device.type == "cuda":
        local = local.pin_memory()
    counts = local.to(device, non_blocking=True)
    dist.all_reduce(counts, group=meshes.dp.get_group())
    return counts


class StepTallies:
    """The device-side tallies of the steps since the last sync step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.since_sync = torch.zeros(len(COUNTS), dtype=torch.float64, device=device)
        self.nonfinite_run = torch.zeros((), device=device)  # consecutive skipped steps
        self.nonfinite_new = torch.zeros((), device=device)  # skipped since the last sync
        # [nll, aux, global targets, global sequences, grad norm] of the last step
        self.last_step: torch.Tensor | None = None

    def record(
        self,
        sums: torch.Tensor,
        counts: torch.Tensor,
        grad_norm: torch.Tensor,
        found_inf: torch.Tensor,
    ) -> None:
        """One step: its [nll, aux] sums, its ``global_counts``, its gradient norm and whether
        it was skipped (1.0) for a non-finite norm."""
        self.nonfinite_run.add_(found_inf).mul_(found_inf)
        self.nonfinite_new.add_(found_inf)
        self.since_sync.add_(counts)
        totals = [counts[COUNTS.index(name)].to(torch.float32) for name in ("targets", "sequences")]
        self.last_step = torch.cat([sums, torch.stack([*totals, grad_norm])])

    def read_back(self, meshes: Meshes, pp_group, stop_flag: float) -> Synced | None:
        """The one host sync of a sync step (collective; None before the job's first step). Each
        rank holds its own share of the loss: summed over data-parallel ranks, over CP ranks
        (each has its positions' token losses) and over pipeline stages (the loss is on the
        last stage, balance losses on all)."""
        if self.last_step is None:
            return None
        loss_parts = self.last_step[:2].clone()
        dist.all_reduce(loss_parts, group=meshes.dp.get_group())
        if meshes.dims.cp_enabled:
            dist.all_reduce(loss_parts[:1], group=meshes.cp.get_group())
        if pp_group is not None:
            dist.all_reduce(loss_parts, group=pp_group)
        flag = torch.tensor([stop_flag], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        values = torch.cat(
            [
                loss_parts.double(),
                self.last_step[2:].double(),
                self.since_sync,
                torch.stack([self.nonfinite_run, self.nonfinite_new]).double(),
                flag.double(),
            ]
        ).tolist()
        self.since_sync.zero_()
        self.nonfinite_new.zero_()
        return Synced(*values)
