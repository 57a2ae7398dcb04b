"""What each rank's own generators draw, at several layouts in one process group.

For each run of the spec (a config name and its overrides) every rank builds the ``Trainer`` as a
job builds it, then records a digest of its torch generator's state as the trainer left it, and,
unless the run is pipelined, the digests of the dropout masks its LoRA adapters drew in one
training step, and of the generator's state before each draw, on one batch that every rank holds
(rank 0's first batch of the real pipeline, sent to all): ranks reading different data would draw
masks of other shapes anyway.

Usage: ``torchrun --nproc-per-node=N -m tests.harness.workers.rank_draws_worker SPEC.json OUT``,
SPEC holding ``{"runs": [{"config": NAME, "overrides": [...]}, ...]}``; OUT gets one JSON line
per run and rank: ``{"run", "rank", "generator", "masks", "states"}``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from orchestrator.planner.plan_check import compose_training_config
from train.loop.stop import StopRequest
from train.parallel.distributed import init_distributed
from train.trainer import Trainer, preflight


def digest(tensor: torch.Tensor) -> str:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return hashlib.sha256(local.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def dropout_draws(trainer: Trainer) -> dict[str, list[str]]:
    """One training step on a batch every rank shares: the digests of each dropout's mask and
    of the generator's state as it drew it (CP peers hold different positions, whose padding
    differs, so their masks are compared by the state they were drawn from)."""
    drawn: dict[str, list[str]] = {"masks": [], "states": []}

    def before(_module, _inputs) -> None:
        drawn["states"].append(digest(torch.get_rng_state()))

    def after(_module, inputs, output) -> None:
        # Dropped: zero out of a non-zero input.
        drawn["masks"].append(digest((output == 0) & (inputs[0] != 0)))

    dropouts = [
        module
        for module in trainer.model.modules()
        if isinstance(module, torch.nn.Dropout) and module.p > 0
    ]
    hooks = [module.register_forward_pre_hook(before) for module in dropouts]
    hooks += [module.register_forward_hook(after) for module in dropouts]
    shared = [next(trainer.data.batches()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    trainer.train_step([shared[0]])
    for hook in hooks:
        hook.remove()
    return drawn


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    device = init_distributed()
    rows = []
    for index, run in enumerate(spec["runs"]):
        torch._dynamo.reset()
        cfg = compose_training_config(["--config-name", run["config"], *run["overrides"]])
        trainer = Trainer(cfg, preflight(cfg), device, StopRequest(0.0))
        generator = digest(torch.get_rng_state())
        drawn = {"masks": [], "states": []} if trainer.plan is not None else dropout_draws(trainer)
        rows.append({"run": index, "rank": dist.get_rank(), "generator": generator, **drawn})
        dist.barrier()
    gathered: list[list[dict] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        lines = [json.dumps(row) for rank_rows in gathered for row in rank_rows or []]
        Path(out_path).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
