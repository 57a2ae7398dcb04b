"""The CPU copy that an asynchronous save writes, so the loop waits only while it is made.

While the loop waits, the state is copied into CPU buffers allocated at the first save and
reused by every later one (one flat buffer per dtype, pinned on CUDA; a few ``_foreach_copy_``
calls instead of one copy per tensor). A buffer is only overwritten by the next save, after the
manager has finalized the one that wrote it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _tensor_leaves(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of a state dict, in the order ``_with_tensors`` replaces them."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensor_leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensor_leaves(value)


def _with_tensors(tree: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``tree`` with its tensors replaced by ``tensors`` (in ``_tensor_leaves`` order) and its
    other leaves copied: a snapshot that the loop's next steps cannot change."""
    if isinstance(tree, (int, float, str, type(None))):  # most leaves (hyperparameters)
        return tree
    if isinstance(tree, torch.Tensor):
        return next(tensors)
    if isinstance(tree, dict):
        return {key: _with_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_with_tensors(value, tensors) for value in tree]
    if isinstance(tree, tuple):
        return tuple(_with_tensors(value, tensors) for value in tree)
    return copy.deepcopy(tree)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Staging:
    """CPU copies of a state dict's tensors for asynchronous saves, in one flat buffer per dtype
    (pinned when the state is on CUDA), allocated at the first save and reused by the next ones.

    A save then costs one ``_foreach_copy_`` per device and dtype (DCP's own staging deep-copies
    the state dict, ~1,000 tensors one by one), and DCP gets a state dict that is already on the
    CPU. DTensors keep their mesh and placements: the staged
    one wraps the CPU copy of the local shard under the original's spec (``from_local`` would
    move it back to the mesh's device). Not thread-safe; the caller must not stage again while
    a write of the previous staged dict is in flight."""

    def __init__(self) -> None:
        self._layout: list[tuple[torch.dtype, torch.Size]] = []
        self._views: list[torch.Tensor] = []

    def _allocate(self, local: list[torch.Tensor]) -> None:
        """One buffer per dtype for ``local`` (the tensors as this rank holds them), and a view
        into it for each."""
        offsets: list[int] = []
        sizes: dict[torch.dtype, int] = {}
        for t in local:
            offsets.append(sizes.get(t.dtype, 0))
            sizes[t.dtype] = offsets[-1] + t.numel()
        pin = any(t.is_cuda for t in local)
        buffers = {
            dtype: torch.empty(size, dtype=dtype, device="cpu", pin_memory=pin)
            for dtype, size in sizes.items()
        }
        self._views = [
            buffers[t.dtype][offset : offset + t.numel()].view(t.shape)
            for t, offset in zip(local, offsets, strict=True)
        ]
        self._layout = [(t.dtype, t.shape) for t in local]

    @torch.no_grad()
    def stage(self, state: dict) -> dict:
        """A copy of ``state`` whose tensors are views into the reused CPU buffers, complete
        when this returns (on CUDA, after one stream sync)."""
        tensors = list(_tensor_leaves(state))
        local = [_local(t) for t in tensors]
        if [(t.dtype, t.shape) for t in local] != self._layout:
            self._allocate(local)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for view, t in zip(self._views, local, strict=True):
            targets, sources = groups.setdefault((t.device, t.dtype), ([], []))
            targets.append(view)
            sources.append(t)
        cuda = any(device.type == "cuda" for device, _ in groups)
        for targets, sources in groups.values():
            torch._foreach_copy_(targets, sources, non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream().synchronize()
        staged = (
            DTensor(view, t._spec, requires_grad=False) if isinstance(t, DTensor) else view
            for view, t in zip(self._views, tensors, strict=True)
        )
        return _with_tensors(state, staged)
