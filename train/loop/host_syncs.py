"""Host syncs made visible on a GPU: a training step under ``torch.cuda.set_sync_debug_mode``.

A host sync (a tensor's value read into Python, a copy to pageable host memory, an op whose
output size depends on data) stalls the CPU until the GPU has caught up, so the next step's
kernels are not queued in time. The CPU suite records such reads (tests/test_host_syncs.py);
on a GPU, CUDA itself names them: ``debug.host_syncs=warn`` warns at each, ``error`` raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # train.config reads the modes on the submit path, where torch need not be
    import torch

OFF = "off"
HOST_SYNC_MODES = (OFF, "warn", "error")


@contextlib.contextmanager
def checked_for_host_syncs(mode: str, device: torch.device) -> Iterator[None]:
    """Run the block under CUDA's sync debug ``mode`` (nothing on another device or when off)."""
    if mode == OFF or device.type != "cuda":
        yield
        return
    import torch

    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class HostSyncGuard:
    """``debug.host_syncs`` over a job's training steps, after its first ``warmup`` ones (which
    compile, measure memory and set things up; logging, saves and validation stay outside)."""

    def __init__(self, mode: str, warmup: int, device: torch.device) -> None:
        self.mode, self.warmup, self.device = mode, warmup, device

    def step(self, steps_done: int) -> contextlib.AbstractContextManager[None]:
        """The context of the job's training step after ``steps_done`` steps of this job."""
        return checked_for_host_syncs(self.mode if steps_done >= self.warmup else OFF, self.device)
