"""The planner's parameter, gradient and optimizer bytes are exactly what the trainer allocates.

Each case is a layout of the tiny dense or MoE preset (tests/harness/planner_cases.py), one
training step through the trainer's own ``Trainer.train_step`` on real torchrun ranks (gloo,
CPU), whose first-step measurement (``Trainer.state_memory``, train/memory.py: the ``memory``
record of metrics.jsonl) is compared with the planner's figure for the rank's pipeline stage.
The planner prices the busiest rank of a stage, TP rank 0 and FSDP shard 0 (the largest
``torch.chunk`` piece and a full padded shard): there, and on every data-parallel replica of it,
the bytes must be equal; every other rank must hold no more.

The bf16 case runs FSDP2's mixed precision (bf16 parameters in compute, fp32 shards, fp32
gradient reduction), which the trainer applies on CUDA only, on CPU: see
tests/harness/workers/planner_worker.py.
"""

from __future__ import annotations

import pytest

from orchestrator.planner.state import group, state_bytes
from tests.harness.planner_cases import CASES, measured, pipeline
from train.memory import STATE_KINDS
from train.models.inventory import inventory

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_bytes_are_exact_on_the_rank_the_planner_prices(name):
    case = CASES[name]
    cfg = case.shape()
    dims = case.dims()
    plan = pipeline(cfg, dims)
    grouped = group(inventory(cfg), case.frozen())
    priced = 0
    for row in measured(name):
        coords = dims.coordinates(row["rank"])
        priced_bytes = state_bytes(
            grouped, dims, plan, case.strategy, case.bf16, cfg.n_experts, coords.pp, tp_rank=0
        )
        figures = (priced_bytes.params, priced_bytes.grads, priced_bytes.optimizer)
        predicted = dict(zip(STATE_KINDS, figures, strict=True))
        actual = {kind: row[kind] for kind in STATE_KINDS}
        where = f"{name} rank {row['rank']}: planner {predicted}, trainer {actual}"
        if coords.tp == coords.dp_shard == coords.cp == 0:
            priced += 1
            assert actual == predicted, where
        else:
            assert all(actual[kind] <= predicted[kind] for kind in STATE_KINDS), where
    assert priced == dims.pp * dims.dp_replicate
