"""Runs the trainer's own training steps on real corpus batches and records, on every rank, each
host sync they would make on a GPU (where each stalls the CPU until the device catches up).

    torchrun --standalone --nproc-per-node=2 tests/harness/workers/host_sync_worker.py \
        --corpus DIR --preset tiny_moe --ep 2 --out DIR

After one warm-up step, ``--steps`` calls of ``Trainer.train_step`` (forward, backward, gradient
clipping, the optimizer; no sync step) run under ``HostReads``. Each rank writes
``rank<r>.json``: the reads at the deliberate sites (``DELIBERATE``: expert parallelism's split
sizes) and every other read, each named by its site (the innermost frame in train/).

Then the positive controls, with a sync planted in the step (``planted``: the gradient norm read
back, as a step that logged it would): one step under ``HostReads`` (what it records), one under
the trainer's own ``HostSyncGuard`` (train/loop/host_syncs.py) for a CUDA device in ``error`` mode,
with CUDA's sync debug mode stood in for by ``HostReads(raising=True)`` (the error it raises),
and one under a guard still warming up (no error).

What ``HostReads`` records:

- a value read into Python: ``aten._local_scalar_dense`` (``.item()``, ``int``, ``float``,
  ``bool``, a tensor as an index), ``aten.equal``, ``aten.allclose``;
- a copy to the host: ``Tensor.tolist``, ``.numpy``, ``.cpu`` (hooked in Python: on the CPU they
  dispatch no copy), ``copy_`` into a host tensor;
- an op whose output size depends on data: nonzero, masked_select, indexing or ``index_put``
  with a boolean mask, unique, bincount, ``repeat_interleave`` without ``output_size``;
- a blocking copy to the device (``Tensor.to(device)`` of a host tensor without
  ``non_blocking``): it waits for the device's queue to drain.

Host and device on a CPU run: every tensor is on the CPU, so its device says nothing. The
recorder keeps where each would live on a GPU. A tensor is on the host when it is marked
(``mark_host``: the worker marks the data loader's batch) or computed by ops whose tensor inputs
are all on the host; every other tensor is a device tensor: parameters, gradients, optimizer
state, activations, and any fresh tensor (a factory or a constant: ``device="cpu"`` and
``device=self.device`` are the same argument here). Reads of host tensors are no syncs (the
trainer's length arithmetic: ``host_seq_len``, ``global_counts``) and are not recorded.
``Tensor.to(device)`` of a host tensor moves it to the device: it returns a copy, as on a GPU,
that is a device tensor. The real ``to_device`` hands a CPU model the host batch itself, so the
worker moves the batch with ``Tensor.to`` instead.

What it cannot see on a CPU: ``.to("cpu")`` of a device tensor (the same call as
``.to(device)`` here, not recorded; ``.cpu()`` is), syncs of CUDA calls with no CPU counterpart
(``torch.cuda.synchronize``, events, a copy between pageable and device memory outside
``Tensor.to``, as in ``torch.tensor(data, device=cuda)``) and syncs inside CUDA kernels of ops
that have none on the CPU. A host computation that starts from a fresh tensor instead of the
batch counts as device work: its reads are recorded (loudly, never silently missed). On a GPU,
``debug.host_syncs`` (train/loop/host_syncs.py) has CUDA name every sync.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from train import trainer as trainer_module
from train.config import TrainConfig
from train.loop import step
from train.loop.host_syncs import HostSyncGuard
from train.loop.stop import StopRequest
from train.models.batch import Batch
from train.parallel.distributed import init_distributed
from train.trainer import Trainer, preflight

REPO = Path(__file__).resolve().parents[3]
THIS = Path(__file__).resolve()
# Deliberate reads, by (file, function): expert parallelism's split sizes (train/models/moe.py).
DELIBERATE = frozenset({("train/models/moe.py", "host_split_sizes")})
HOST_MARK = "_host_by_design"
PLANTED_STEPS = 3  # the positive controls' steps, after the recorded ones

aten = torch.ops.aten
VALUE_READS = frozenset({aten._local_scalar_dense, aten.equal, aten.allclose})
DATA_SIZED = frozenset(
    {
        aten.nonzero,
        aten.masked_select,
        aten._unique,
        aten._unique2,
        aten.unique_dim,
        aten.unique_consecutive,
        aten.unique_dim_consecutive,
        aten.bincount,
    }
)
INDEXING = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
# Tensor methods hooked in Python while recording: on the CPU they dispatch no copy.
TO_HOST = ("tolist", "numpy", "cpu")


def mark_host(*tensors: torch.Tensor) -> None:
    """Mark tensors that live on the host by design (the data loader's batch)."""
    for tensor in tensors:
        setattr(tensor, HOST_MARK, True)


def on_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` would be on the host on a GPU: marked, or computed from marked ones."""
    return getattr(tensor, HOST_MARK, False)


def set_host(tensor: torch.Tensor, host: bool) -> None:
    if host:
        mark_host(tensor)
    elif on_host(tensor):
        delattr(tensor, HOST_MARK)


def site() -> tuple[str, int, str]:
    """(file, line, function) of the innermost frame in train/ that led here; outside train/
    (a unit test), the innermost frame in tests/ other than this module."""
    fallback = None
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        in_train = path.is_relative_to(REPO / "train")
        if in_train or (fallback is None and path.is_relative_to(REPO / "tests") and path != THIS):
            where = (path.relative_to(REPO).as_posix(), frame.f_lineno, frame.f_code.co_name)
            if in_train:
                return where
            fallback = where
        frame = frame.f_back
    return fallback or ("?", 0, "?")


class HostReads(TorchDispatchMode):
    """Records every host sync of the ops run inside it (see the module's docstring), each as
    ``"file:line function: kind"``: in ``deliberate`` at a ``DELIBERATE`` site, else in
    ``reads``."""

    def __init__(self, raising: bool = False) -> None:
        super().__init__()
        self.raising = raising  # as CUDA's ``error`` mode: the first read outside DELIBERATE
        self.reads: list[str] = []
        self.deliberate: list[str] = []

    def record(self, kind: str) -> None:
        path, line, function = site()
        reads = self.deliberate if (path, function) in DELIBERATE else self.reads
        reads.append(f"{path}:{line} {function}: {kind}")
        if self.raising and reads is self.reads:
            raise RuntimeError(f"called a synchronizing operation: {reads[-1]}")

    def __enter__(self) -> HostReads:
        for name in TO_HOST:
            setattr(torch.Tensor, name, self.copying_to_host(name, getattr(torch.Tensor, name)))
        torch.Tensor.to = self.moving(torch.Tensor.to)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for name in (*TO_HOST, "to"):  # torch._C.TensorBase's methods show again
            delattr(torch.Tensor, name)
        super().__exit__(*exc)

    def copying_to_host(self, name: str, method: Callable) -> Callable:
        """Tensor ``method``, recording each call on a device tensor."""

        def hooked(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not on_host(tensor):
                self.record(name)
            return method(tensor, *args, **kwargs)

        return hooked

    def moving(self, method: Callable) -> Callable:
        """``Tensor.to``: a host tensor moved to a device becomes a device tensor (a copy, as
        on a GPU); without ``non_blocking`` the copy waits for the device."""

        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = method(tensor, *args, **kwargs)
            parsed = {key: value for key, value in kwargs.items() if key != "copy"}
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **parsed)
            if device is None or not on_host(tensor):
                return out
            if not non_blocking:
                self.record("to(device) without non_blocking")
            moved = out.clone() if out is tensor else out
            set_host(moved, False)
            return moved

        return to

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = bool(tensors) and all(on_host(t) for t in tensors)
        if not host and syncs(func, args, kwargs):
            self.record(func.overloadpacket.__name__)
        out = func(*args, **kwargs)
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                set_host(tensor, host)
        return out


def syncs(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` reads a device tensor's value back, copies it into a host tensor or sizes
    its output by its data (its tensors are not all on the host)."""
    packet = func.overloadpacket
    if packet in VALUE_READS or packet in DATA_SIZED:
        return True
    if packet in INDEXING:
        masks = (i for i in args[1] if isinstance(i, torch.Tensor))
        return any(mask.dtype in (torch.bool, torch.uint8) for mask in masks)
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is aten.copy_.default:
        return on_host(args[0]) and not on_host(args[1])
    return False


class StandInSyncDebugMode:
    """``torch.cuda.set_sync_debug_mode`` on a CPU: ``error`` records host reads as CUDA would
    see syncs and raises at the first; ``default`` stops."""

    def __init__(self) -> None:
        self.modes: list[str] = []
        self.recorder: HostReads | None = None

    def __call__(self, mode: str) -> None:
        self.modes.append(mode)
        if self.recorder is not None:
            self.recorder.__exit__(None, None, None)
            self.recorder = None
        if mode == "error":
            self.recorder = HostReads(raising=True).__enter__()


def planted(clip: Callable) -> Callable:
    """``clip_grad_norm`` whose norm is read back, as a step that logged it would."""

    def clip_and_read(*args: Any, **kwargs: Any) -> torch.Tensor:
        norm = clip(*args, **kwargs)
        float(norm)
        return norm

    return clip_and_read


def planted_controls(trainer: Trainer, batches: list[list]) -> dict[str, Any]:
    """The positive controls of the module's docstring, on three more batches."""
    trainer_module.clip_grad_norm = planted(trainer_module.clip_grad_norm)
    with HostReads() as recorder:
        trainer.train_step(batches[0])
    torch.cuda.set_sync_debug_mode = stand_in = StandInSyncDebugMode()
    cuda = torch.device("cuda")  # a device object only: nothing is allocated on it
    with HostSyncGuard("error", 1, cuda).step(0):  # warming up: not armed
        trainer.train_step(batches[1])
    guard_error = None
    try:
        with HostSyncGuard("error", 1, cuda).step(1):
            trainer.train_step(batches[2])
    except RuntimeError as error:
        guard_error = str(error)
    return {"planted_reads": recorder.reads, "guard_error": guard_error, "modes": stand_in.modes}


def moved_with_to(batch: Batch, device: torch.device) -> Batch:
    """``step.to_device`` through ``Tensor.to``, as on a GPU (see the module's docstring)."""
    return Batch(*(None if t is None else t.to(device, non_blocking=True) for t in batch))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True, help="directory for each rank's rank<r>.json")
    args = parser.parse_args()

    out = Path(args.out)
    cfg = TrainConfig()
    cfg.run_dir = str(out / "run")
    cfg.model.preset = args.preset
    cfg.parallel.ep = args.ep
    cfg.data.corpus = args.corpus
    cfg.data.max_duration = 5.0
    cfg.data.num_workers = 0
    cfg.wandb.enabled = False
    prepared = preflight(cfg)
    device = init_distributed(cfg.train.hang_timeout_s)
    trainer = Trainer(cfg, prepared, device, StopRequest(0.0))
    batches = trainer.data.batches()
    trainer.train_step([next(batches)])  # the first step also measures the state's memory

    step_batches = [[next(batches)] for _ in range(args.steps + PLANTED_STEPS)]
    for (batch,) in step_batches:
        mark_host(*(value for value in batch.values() if isinstance(value, torch.Tensor)))
    step.to_device = moved_with_to
    clean, controls = step_batches[: args.steps], step_batches[args.steps :]
    with HostReads() as recorder:
        for batch in clean:
            trainer.train_step(batch)
    result = {
        "reads": recorder.reads,
        "deliberate": recorder.deliberate,
        "batch_sizes": [len(batch[0]["token_lens"]) for batch in clean],
        **planted_controls(trainer, controls),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
