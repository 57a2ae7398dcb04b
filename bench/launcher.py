"""How the benches start the toolkit's distributed entrypoints: one place for the command."""

from __future__ import annotations

import sys


def torchrun(nproc: int) -> list[str]:
    """``torch.distributed.run`` of this interpreter on one machine, ``nproc`` ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
