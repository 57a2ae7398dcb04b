"""One rank's stream of training batches and its position, which every checkpoint saves.

A job resumed with the checkpoint's seed continues the stream where it was saved (the samplers
are put back at the position, not fed the batches again: ``train.data.loader``), under the data
layout it was saved with (``train.data.layout``: ``data.on_layout_change`` says what a changed one
does); a job with another seed starts a new order.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from contract.run_dir import CUTS_PREFIX
from train.checkpoint.location import Ref, checkpoint_name
from train.config import (
    BALANCE_FLOPS,
    CONTINUE,
    RESTART_EPOCH,
    ConfigError,
    TrainConfig,
    balance_mode,
    data_path,
)
from train.data.balance import Balance
from train.data.features import Featurizer
from train.data.layout import DATA_LAYOUT, data_layout, layout_changes, num_streams, refusal
from train.data.loader import DataPosition, LoadedBatch, TextCodec, batches_from, build_dataloader
from train.data.plan import DataPlan
from train.data.work import flops_cost
from train.models.shape import SALMConfig
from train.parallel.distributed import say


class TrainingData:
    """This data-parallel rank's batches, their position, and what it drew and skipped."""

    def __init__(
        self,
        cfg: TrainConfig,
        plan: DataPlan,
        dp_rank: int,
        dp_size: int,
        text: TextCodec,
        featurize: Featurizer,
        device: torch.device,
        shape: SALMConfig,
    ) -> None:
        self.cfg, self.plan, self.text, self.featurize = cfg, plan, text, featurize
        self.dp_rank, self.dp_size, self.device = dp_rank, dp_size, device
        self.balance = None  # by seconds: lhotse's sampler as it deals
        if balance_mode(cfg) == BALANCE_FLOPS:
            cost = flops_cost(shape, text, featurize.hop_s, featurize.sampling_rate)
            self.balance = Balance(cost, cfg.data.balance_window)
        self.position: dict[str, Any] = {"epoch": 0, "batch_in_epoch": 0, "data_seed": cfg.seed}
        read = [check.source for check in plan.training] if plan.training else None
        self.layout = data_layout(cfg, dp_size, read)  # what the position depends on
        self.restart: dict | None = None  # a changed layout's new epoch, for metrics.jsonl
        # Cuts drawn from each training source and cuts skipped, on this rank since the last
        # metrics line (summed over ranks as it is written).
        self.drawn = dict.fromkeys(plan.source_names, 0)
        self.skipped = 0

    def state_dict(self) -> dict[str, Any]:
        """The position for the checkpoint. Collective: every rank's position is gathered (Shar
        ranks are each at their own), by data-parallel rank."""
        gathered: list[tuple[int, dict] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.dp_rank, self.position))
        by_dp_rank = dict(gathered)
        positions = [
            {k: v for k, v in by_dp_rank[r].items() if k != "data_seed"}
            for r in range(self.dp_size)
        ]
        return {
            "data_position": dict(self.position),
            "data_positions": positions,
            DATA_LAYOUT: self.layout,
        }

    def resume(self, state: Mapping[str, Any], checkpoint: Ref) -> bool:
        """Continue from the checkpoint's position when it was saved with this job's seed (the
        return: whether it was); otherwise the stream starts a new order."""
        saved = state.get("data_position") or {}
        if saved.get("data_seed") != self.cfg.seed:
            return False
        per_rank = state.get("data_positions") or []
        mine = per_rank[self.dp_rank] if self.dp_rank < len(per_rank) else {}
        self.position = {**saved, **mine}
        self.resume_layout(state.get(DATA_LAYOUT), checkpoint)
        return True

    def resume_layout(self, saved: dict | None, checkpoint: Ref) -> None:
        """The saved position under a changed data layout, as data.on_layout_change says
        (train/data/layout.py); the preflight has refused it already unless it says otherwise."""
        if saved is None:
            return  # saved before layouts were recorded
        changes = layout_changes(saved, self.layout)
        if not changes:
            return
        policy = self.cfg.data.on_layout_change
        what = "; ".join(changes)
        since = checkpoint_name(checkpoint)
        if policy == CONTINUE:
            say(
                f"warning: the data layout changed since {since} ({what}); its batch "
                f"counts are applied as they are (data.on_layout_change={CONTINUE}): data may "
                "be skipped or read twice"
            )
        elif policy == RESTART_EPOCH:
            epoch = int(self.position.get("epoch", 0)) + 1
            self.position = {"epoch": epoch, "batch_in_epoch": 0, "data_seed": self.cfg.seed}
            self.restart = {"data_layout_change": RESTART_EPOCH, "data_epoch": epoch}
            say(
                f"the data layout changed since {since} ({what}): starting data epoch "
                f"{epoch} from its beginning (data.on_layout_change={RESTART_EPOCH}); the rest "
                f"of epoch {epoch - 1} is not read"
            )
        else:
            raise ConfigError(refusal(str(checkpoint), changes))

    def batches(self) -> Iterator[LoadedBatch]:
        """This rank's batches from the position, each counted as it is handed out."""
        cfg = self.cfg
        streams = 1 if self.plan.training else num_streams(cfg.data.shar, cfg.data.num_workers)
        start, replay = DataPosition.resume(self.position, streams)
        common = {
            "max_duration": cfg.data.max_duration,
            "job_seed": cfg.seed,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "num_workers": cfg.data.num_workers,
            "text": self.text,
            "featurize": self.featurize,
            "buckets": cfg.data.buckets,
            "buffer_size": cfg.data.buffer_size,
            "pin_memory": self.device.type == "cuda",
            "balance": self.balance,
        }
        data, shar = (
            (self.plan.training, False) if self.plan.training else (data_path(cfg), cfg.data.shar)
        )

        def loader(epoch: int, position: DataPosition | None):
            return build_dataloader(data, shar=shar, epoch=epoch, position=position, **common)

        for position, batch in batches_from(loader, start, replay):
            self.position = {**position.state(), "data_seed": cfg.seed}
            self.note_cuts(batch)
            yield batch

    def note_cuts(self, batch: LoadedBatch) -> None:
        """Count a batch's cuts by source, and report the cuts its worker had to skip."""
        for source in batch["sources"]:
            if source in self.drawn:
                self.drawn[source] += 1
        for line in batch["skipped"]:
            self.skipped += 1
            rank = dist.get_rank()
            print(f"[train] rank {rank}: skipped {line}", file=sys.stderr, flush=True)

    def cut_counts(self, dp_group: dist.ProcessGroup) -> dict[str, int]:
        """Cuts drawn from each training source and cuts skipped since the last metrics line,
        summed over data-parallel ranks (``cuts/<source>``, ``skipped_cuts``). Collective."""
        counts = torch.tensor(
            [*self.drawn.values(), self.skipped], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(counts, group=dp_group)
        *drawn, skipped = (int(value) for value in counts.tolist())
        record = {f"{CUTS_PREFIX}{name}": n for name, n in zip(self.drawn, drawn, strict=True)}
        self.drawn = dict.fromkeys(self.drawn, 0)
        self.skipped = 0
        return {**record, "skipped_cuts": skipped}
