"""``debug.device_trap``: a tensor made without a device fails on the CPU as it would on a GPU.

On a GPU, a tensor made without ``device=`` lands on the CPU, and the first op that mixes it
with the model's tensors fails, only there (once: a CPU ``torch.eye`` OR-ed with a CUDA mask in
the KV cache's prefill). With the trap on, the training step, the sync step's read-back and cut
counts, and validation's forwards run with tensor factories defaulting to the meta device: such
a tensor becomes a meta tensor, and the op that mixes it with CPU tensors fails on the CPU the
same way, at whatever parallel layout the run has. Deliberate host tensors say
``device="cpu"``; data loading, saving and logging stay outside.
"""

from __future__ import annotations

import contextlib

import torch


def trapped(enabled: bool) -> contextlib.AbstractContextManager:
    """The trap's context when ``enabled``, else one that does nothing."""
    return torch.device("meta") if enabled else contextlib.nullcontext()
