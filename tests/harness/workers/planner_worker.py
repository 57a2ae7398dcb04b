"""Measures what the planner predicts, for tests/test_planner_memory.py and
tests/test_planner_activations.py: several layouts in one launch, each through the trainer's own
``Trainer`` (model build, parallelization, runner, fused AdamW, ``train_step``).

    torchrun --standalone --nproc-per-node=2 tests/harness/workers/planner_worker.py \
        OUT.json CASES.json
    python tests/harness/workers/planner_worker.py OUT.json CASES.json  (one plain process)

Per case (``tests.harness.planner_cases.Case``: the launch's layouts, in turn), each rank trains
one step (four with ``activations``) on one synthetic batch and reports:

- its parameter, gradient and optimizer-state bytes as the trainer measures them at its first
  step (``Trainer.state_memory``, what the ``memory`` record of metrics.jsonl holds);
- with ``activations``, the activation bytes of the next three steps, the least: the most
  bytes held at once by the storages the step's forward and backward allocate, gradients
  excepted (``Allocations``).

A ``bf16`` case runs FSDP2's mixed precision on CPU: the trainer applies it on CUDA only
(``fsdp_mixed_precision``), so the worker widens that predicate to CPU; the policy, and so what
FSDP2 allocates, is the one a GPU job gets. Rank 0 writes one JSON list of every rank's rows.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from tests.harness.planner_cases import Case
from train import trainer as trainer_module
from train.config import TrainConfig
from train.data.plan import data_plan
from train.loop.stop import StopRequest
from train.models import parallelize
from train.models.moe import local_shard
from train.parallel.distributed import init_distributed
from train.parallel.layout import parallel_dims, pipeline_for
from train.trainer import Prepared, Trainer

DATA_SEED = 7


class Allocations(TorchDispatchMode):
    """The storages ops allocate while active (an output whose storage is none of the op's
    inputs'), followed until they are freed: the timeline of live bytes, from which
    ``peak(excluded)`` is the most bytes live at once without the storages in ``excluded``."""

    def __init__(self) -> None:
        super().__init__()
        self.index: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.refs: dict[int, weakref.ref] = {}
        self.sizes: list[int] = []
        self.events: list[tuple[int, int]] = []  # (storage number, +1 allocated / -1 freed)

    def __torch_dispatch__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which this mode then sees
        out = func(*args, **(kwargs or {}))
        inputs = {id(storage) for storage in storages((args, kwargs))}
        for storage in storages(out):
            if id(storage) in inputs or storage in self.index:
                continue
            number = len(self.sizes)
            self.index[storage] = number
            self.sizes.append(storage.nbytes())
            self.events.append((number, 1))
            self.refs[number] = weakref.ref(storage, lambda _, n=number: self.freed(n))
        return out

    def freed(self, number: int) -> None:
        self.events.append((number, -1))

    def numbers(self, tensors: Iterator[torch.Tensor]) -> set[int]:
        """The numbers of the storages behind ``tensors`` that were allocated here."""
        return {
            self.index[storage]
            for t in tensors
            if (storage := local_shard(t).untyped_storage()) in self.index
        }

    def peak(self, excluded: set[int]) -> int:
        live = most = 0
        for number, sign in self.events:
            if number not in excluded:
                live += sign * self.sizes[number]
                most = max(most, live)
        return most


def storages(tree: object) -> Iterator[torch.UntypedStorage]:
    """The storages of the plain tensors in ``tree``, looking inside wrapper subclasses (such as
    the all-gathers' AsyncCollectiveTensor) for the tensors that hold the memory."""
    for t in tree_leaves(tree):
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from storages([getattr(t, name) for name in names])
        else:
            yield t.untyped_storage()


def synthetic_batch(sequences: int, frames: int, tokens: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED)
    return {
        "features": torch.randn(sequences, frames, 80, generator=g),
        "feature_lens": torch.full((sequences,), frames),
        "tokens": torch.randint(0, 256, (sequences, tokens), generator=g),
        "token_lens": torch.full((sequences,), tokens),
        # The byte tokenizer's examples: the audio first, the answer after BOS.
        "audio_at": torch.zeros(sequences, dtype=torch.int64),
        "target_mask": (torch.arange(tokens) >= 1).expand(sequences, -1),
    }


def config(case: Case, run_dir: str) -> TrainConfig:
    cfg = TrainConfig(run_dir=run_dir, strategy=case.strategy)
    cfg.model = case.model()
    cfg.mixed_precision = case.bf16
    for key, value in case.parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


@contextmanager
def mixed_precision_on_cpu(enabled: bool) -> Iterator[None]:
    """FSDP2's bf16 policy on CPU too (the trainer's predicate, without its CUDA condition)."""
    if not enabled:
        yield
        return

    def on_any_device(_meshes, options) -> bool:
        return options.mixed_precision and options.strategy == "fsdp2"

    with (
        mock.patch.object(parallelize, "fsdp_mixed_precision", on_any_device),
        mock.patch.object(trainer_module, "fsdp_mixed_precision", on_any_device),
    ):
        yield


def measure(name: str, case: Case, device: torch.device, run_dir: str) -> dict:
    cfg = config(case, run_dir)
    dims = parallel_dims(cfg, dist.get_world_size())
    with mixed_precision_on_cpu(case.bf16):
        prepared = Prepared(dims, pipeline_for(cfg, dims), data_plan(cfg, print), None)
        trainer = Trainer(cfg, prepared, device, StopRequest())
        batch = synthetic_batch(*case.batch)
        trainer.train_step([batch])  # measures state_memory, as a job's first step does
        row = {"case": name, "rank": dist.get_rank(), **trainer.state_memory}
        if case.activations:
            # The least of three steps: gloo's worker thread drops its last reference to a
            # collective's tensors only after the waiting thread has gone on, so on a loaded
            # machine a storage can outlive its use by some allocations (+14% on one TP rank,
            # seen twice in a full suite's run: 2 steps were not enough); that is not what the
            # step needs.
            row["activation_bytes"] = min(activation_peak(trainer, batch) for _ in range(3))
    del trainer
    gc.collect()
    return row


def activation_peak(trainer: Trainer, batch: dict[str, torch.Tensor]) -> int:
    """The peak bytes a later ``train_step`` allocates in its forward and backward, less the
    gradients (which the planner counts as state)."""
    tracker = Allocations()
    run = trainer.runner.forward_backward
    grads: set[int] = set()

    def tracked(*args: object) -> torch.Tensor:
        with tracker:
            sums = run(*args)
        grads.update(
            tracker.numbers(p.grad for p in trainer.model.parameters() if p.grad is not None)
        )
        return sums

    with mock.patch.object(trainer.runner, "forward_backward", tracked):
        trainer.train_step([batch])
    return tracker.peak(grads)


def main() -> None:
    out, cases_file = Path(sys.argv[1]), Path(sys.argv[2])
    cases = {name: Case(**spec) for name, spec in json.loads(cases_file.read_text()).items()}
    device = init_distributed()
    rows = []
    with tempfile.TemporaryDirectory() as run_dir:
        for name, case in cases.items():
            mine = measure(name, case, device, run_dir)
            gathered: list[dict | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            rows += gathered
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
