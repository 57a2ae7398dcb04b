"""The chunked head loss on a vocabulary split over the ranks, against ``F.cross_entropy`` over
the full logits of the whole head, as TP runs it:

    torchrun --standalone --nproc-per-node=2 tests/harness/workers/head_loss_worker.py --out DIR

Every rank draws the same hidden states (2 sequences x 8 positions), head (37 rows: 19 and 18
per rank, torch's uneven split) and labels (some ignored, targets in both ranks' rows), takes
its sequence shard of the hidden states (as a DTensor, and as the local tensor a sequence-
parallel norm can hand on) and its rows of the head, and computes the loss in chunks of 5
positions (four chunks, the last short). Rank 0 writes ``head_loss.json``: the largest
relative error of the loss and absolute errors of both gradients, each rank's hidden-state
gradient gathered whole.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from train.models.head_loss import head_loss
from train.models.packing import IGNORE_INDEX

SEQUENCES, POSITIONS, WIDTH, VOCAB, CHUNK = 2, 8, 8, 37, 5


def case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(SEQUENCES, POSITIONS, WIDTH, generator=generator)
    weight = torch.randn(VOCAB, WIDTH, generator=generator)
    labels = torch.randint(0, VOCAB, (SEQUENCES, POSITIONS), generator=generator)
    labels[0, :2] = IGNORE_INDEX
    labels[1, -1] = IGNORE_INDEX
    labels[1, 0], labels[1, 1] = 0, VOCAB - 1  # the first and the last row of the head
    return hidden, weight, labels


def errors(hidden_as_dtensor: bool) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    hidden, weight, labels = case()
    reference_hidden = hidden.clone().requires_grad_()
    reference_weight = weight.clone().requires_grad_()
    logits = F.linear(reference_hidden, reference_weight).flatten(0, 1)
    reference = F.cross_entropy(
        logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    reference.backward()

    shard = distribute_tensor(hidden, mesh, [Shard(1)]).to_local().requires_grad_()
    rows = distribute_tensor(weight, mesh, [Shard(0)]).to_local().requires_grad_()
    local = DTensor.from_local(shard, mesh, [Shard(1)]) if hidden_as_dtensor else shard
    head_rows = DTensor.from_local(rows, mesh, [Shard(0)], shape=weight.shape, stride=(WIDTH, 1))
    loss = head_loss(local, head_rows, labels, CHUNK)
    loss.backward()
    shards = [torch.empty_like(shard.grad) for _ in range(mesh.size())]
    dist.all_gather(shards, shard.grad)
    head: list[torch.Tensor | None] = [None] * mesh.size()  # uneven rows: gloo gathers equal
    dist.all_gather_object(head, rows.grad)
    return {
        "loss_rel": float(abs(loss - reference) / reference),
        "hidden_grad": float((torch.cat(shards, dim=1) - reference_hidden.grad).abs().max()),
        "head_grad": float((torch.cat(head) - reference_weight.grad).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    dist.init_process_group("gloo")
    results = {"dtensor": errors(True), "local": errors(False)}
    if dist.get_rank() == 0:
        (out / "head_loss.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
