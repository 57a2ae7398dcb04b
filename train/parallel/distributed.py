"""The process group and the collectives the training loop needs beside the model's own:
joining the group, the global gradient norm, the check that peers read the same batches, and
rank 0's log line. Kept apart from the trainer, as torchtitan keeps its distributed helpers."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from train.loop.watchdog import process_group_timeout

# How long a rank other than 0 that refuses the config leaves rank 0 to say why before it exits:
# a peer that exited first would have the launcher (torchrun) stop rank 0 before its line.
REFUSAL_GRACE_S = 30.0


def say(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[train] {line}", file=sys.stderr, flush=True)


def init_distributed(hang_timeout_s: float = 0.0) -> torch.device:
    """Join the process group; with ``hang_timeout_s`` its collectives time out a little after
    the hang watchdog would fire (train/loop/watchdog.py), else after torch's default. On CUDA the
    group is bound to this rank's device: NCCL connects now (a bad node fails here, not in the
    first step) and the mesh's subgroups are split from it, one call per mesh dim."""
    timeout = process_group_timeout(hang_timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend, device_id = "nccl", device
    else:
        device, backend, device_id = torch.device("cpu"), "gloo", None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device_id,
        )
    return device


def clip_grad_norm(
    model: torch.nn.Module, max_norm: float, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip to ``max_norm`` (0: only measure) and return the global gradient norm, on device.

    Parameters may live on different meshes (TP'd or not, dense or EP experts): each mesh's
    norm is reduced on its own, the norms are combined (and summed over pipeline stages, which
    hold different parameters), and each mesh's gradients are scaled in one foreach call (per
    device and dtype). Nothing is read back to the host.
    """
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param)
    squares = []
    for params in by_mesh.values():
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    if squares:
        total = torch.stack(squares).sum()
    else:  # a pipeline stage whose parameters are all frozen
        total = torch.zeros((), device=next(model.parameters()).device)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
