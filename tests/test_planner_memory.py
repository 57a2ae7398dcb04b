"""The planner's parameter, gradient and optimizer bytes equal what the trainer measures.

Each case trains one step of the tiny dense or MoE preset under a layout (real torchrun ranks,
gloo, CPU) and reads the trainer's ``memory`` record: every rank's bytes must match the planner's
figure for that rank within 2% (the issue's bound; they match exactly today).
"""

from __future__ import annotations

import json

import pytest

from orchestrator.planner.inventory import inventory, stage_param_counts
from orchestrator.planner.state import group, state_bytes
from tests.test_trainer import train
from train.models.presets import get_preset
from train.models.shape import SALMConfig
from train.parallel_dims import ParallelDims
from train.pipeline_plan import PipelinePlan, plan_pipeline

pytestmark = pytest.mark.slow

TOLERANCE = 0.02
# name: (preset, ranks, strategy, parallel overrides)
LAYOUTS = {
    "one_process": ("tiny", 1, "fsdp2", {}),
    "ddp2": ("tiny", 2, "ddp", {"dp_replicate": 2, "dp_shard": 1}),
    "fsdp2": ("tiny", 2, "fsdp2", {}),
    "hsdp2x2": ("tiny", 4, "fsdp2", {"dp_replicate": 2, "dp_shard": 2}),
    "tp2": ("tiny", 2, "fsdp2", {"tp": 2, "dp_shard": 1}),
    "fsdp2xtp2": ("tiny", 4, "fsdp2", {"tp": 2, "dp_shard": 2}),
    "cp2": ("tiny", 2, "fsdp2", {"cp": 2, "dp_shard": 1}),
    "pp2": ("tiny", 2, "fsdp2", {"pp": 2, "dp_shard": 1}),
    "pp2xfsdp2": ("tiny", 4, "fsdp2", {"pp": 2, "dp_shard": 2}),
    "moe_ep2": ("tiny_moe", 2, "fsdp2", {"ep": 2}),
    "moe_fsdp2xtp2_ep2": ("tiny_moe", 4, "fsdp2", {"tp": 2, "dp_shard": 2, "ep": 2}),
    "moe_tp2": ("tiny_moe", 2, "fsdp2", {"tp": 2, "dp_shard": 1}),
}


def pipeline(cfg: SALMConfig, dims: ParallelDims) -> PipelinePlan | None:
    if dims.pp == 1:
        return None
    blocks, first, last = stage_param_counts(inventory(cfg), cfg.n_layers)
    return plan_pipeline(dims.pp, "1f1b", 0, 0, [], blocks, first, last)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_planner_state_bytes_match_the_trainer(tmp_path, corpus, name):
    preset, ranks, strategy, parallel = LAYOUTS[name]
    overrides = [f"parallel.{key}={value}" for key, value in parallel.items()]
    run_dir = tmp_path / name
    train(
        run_dir,
        corpus,
        f"model.preset={preset}",
        f"strategy={strategy}",
        *overrides,
        "train.max_steps=1",
        nproc=ranks,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (record,) = [row["memory"] for row in rows if "memory" in row]
    assert len(record) == ranks
    cfg = get_preset(preset)
    dims = ParallelDims(world_size=ranks, **parallel)
    plan = pipeline(cfg, dims)
    grouped = group(inventory(cfg))
    for measured in record:
        coords = dims.coordinates(measured["rank"])
        predicted = state_bytes(
            grouped, dims, plan, strategy, False, cfg.n_experts, coords.pp, coords.tp
        )
        for kind, value in (
            ("params_bytes", predicted.params),
            ("grads_bytes", predicted.grads),
            ("optimizer_bytes", predicted.optimizer),
        ):
            assert abs(value - measured[kind]) <= TOLERANCE * measured[kind], (
                f"{name} rank {measured['rank']} {kind}: planner {value}, trainer {measured[kind]}"
            )
