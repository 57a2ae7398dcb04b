"""The one place that reaches torch APIs whose spelling or behaviour differs between the torch
versions the trainer supports: 2.11 (the floor, ``torch>=2.11``) and 2.13.

Each shim picks by feature detection (is the attribute there), never by version string, so a
build in between, or a nightly, takes whichever spelling it has. Its docstring names which version
spells it how. ``tests/test_compat.py`` exercises both spellings on CPU and fails on a direct use
of a shimmed API, or of a name only 2.13 has, anywhere else in ``train/``.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup, distributed_c10d
from torch.distributed.device_mesh import DeviceMesh


def all_gather_autograd(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's ``x`` of ``mesh`` concatenated along dim 0, differentiable: the backward
    reduce-scatters the gradient.

    torch 2.13 spells it ``all_gather_single_autograd`` (its ``all_gather_tensor_autograd`` is a
    deprecated alias that warns on every eager call); 2.11 has only
    ``all_gather_tensor_autograd``. Looked up per call, which torch.compile folds to a constant.
    """
    gather = getattr(funcol, "all_gather_single_autograd", None)
    if gather is None:
        gather = funcol.all_gather_tensor_autograd
    return gather(x, 0, mesh)


def set_group_timeout(group: ProcessGroup, timeout: timedelta) -> None:
    """Give ``group``'s later collectives ``timeout``: gloo raises after it, NCCL's watchdog
    aborts. Subgroups (``new_group``, ``split_group``: every DeviceMesh dim short of the whole
    world) start with torch's default, 30 min for gloo and 10 for NCCL, not the default group's.

    2.11 and 2.13 both spell it ``distributed_c10d._set_pg_timeout(timeout, group)`` (private;
    it sets the gloo or NCCL backend's default timeout). A torch without it is refused.
    """
    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        raise RuntimeError(
            "giving the mesh's process groups train.hang_timeout_s needs "
            "torch.distributed.distributed_c10d._set_pg_timeout (torch>=2.11)"
        )
    set_timeout(timeout, group)
