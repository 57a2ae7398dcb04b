"""ParallelDims: the layout arithmetic, checked without any process group."""

from __future__ import annotations

import pytest

from train.models.presets import get_preset
from train.parallel.dims import ParallelDims

TINY = get_preset("tiny")  # 4 heads, 2 KV heads, no experts
TINY_MOE = get_preset("tiny_moe")  # 4 experts


def test_dp_shard_takes_the_rest_of_the_world():
    dims = ParallelDims(world_size=8, dp_replicate=2, tp=2)
    dims.validate(TINY)
    assert (dims.dp_shard, dims.dp, dims.efsdp) == (2, 4, 4)
    assert dims.fsdp_dims == ("dp_replicate", "dp_shard")
    assert ParallelDims(world_size=4, tp=2).fsdp_dims == ("dp_shard",)


@pytest.mark.parametrize(
    ("dims", "model", "message"),
    [
        (ParallelDims(world_size=4, dp_shard=0), TINY, "dp_shard=0 must be a positive integer"),
        (ParallelDims(world_size=4, tp=0), TINY, "tp=0 must be a positive integer"),
        (ParallelDims(world_size=4, cp=2, dp_shard=1), TINY, "= 2 but the world has 4 ranks"),
        (ParallelDims(world_size=4, pp=4), TINY, "pp=4 is more pipeline stages than the model's 2"),
        (
            ParallelDims(world_size=4, pp=2, dp_shard=1),
            TINY,
            "pp*dp_replicate*dp_shard*cp*tp = 2*1",
        ),
        (ParallelDims(world_size=4, dp_shard=2), TINY, "= 2 but the world has 4 ranks"),
        (ParallelDims(world_size=6, dp_replicate=4), TINY, "dp_shard=-1 cannot fill a world of 6"),
        (ParallelDims(world_size=8, tp=8), TINY, "tp=8 must divide the 4 attention heads"),
        (ParallelDims(world_size=4, tp=4), TINY, "tp=4 must divide the 2 KV heads"),
        (ParallelDims(world_size=2, ep=2), TINY, "ep=2 needs an MoE model"),
        (ParallelDims(world_size=8, ep=8), TINY_MOE, "ep=8 must divide the 4 experts"),
        (
            ParallelDims(world_size=4, dp_replicate=2, dp_shard=2, ep=4),
            TINY_MOE,
            "ep=4 must divide dp_shard*cp*tp = 2",
        ),
    ],
)
def test_each_violation_names_itself(dims, model, message):
    with pytest.raises(ValueError) as err:
        dims.validate(model)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_strategy_is_checked_against_the_layout():
    ParallelDims(world_size=4, dp_replicate=4, dp_shard=1).validate(TINY, "ddp")
    with pytest.raises(ValueError, match="strategy ddp replicates whole models"):
        ParallelDims(world_size=4).validate(TINY, "ddp")
    with pytest.raises(ValueError, match="it needs dp_shard=1, tp=1, ep=1, pp=1, cp=1"):
        ParallelDims(world_size=2, pp=2).validate(TINY, "ddp")
    with pytest.raises(ValueError, match="it needs dp_shard=1, tp=1, ep=1, pp=1, cp=1"):
        ParallelDims(world_size=2, cp=2, dp_shard=1).validate(TINY, "ddp")
    with pytest.raises(ValueError, match="unknown data-parallel strategy 'zero3'"):
        ParallelDims(world_size=4).validate(TINY, "zero3")


def test_coordinates_put_tp_innermost():
    dims = ParallelDims(world_size=8, dp_replicate=2, dp_shard=2, tp=2)
    coords = [dims.coordinates(rank) for rank in range(8)]
    assert [(c.dp_replicate, c.dp_shard, c.tp) for c in coords] == [
        (r, s, t) for r in range(2) for s in range(2) for t in range(2)
    ]
    # TP peers share a data-parallel slot; every slot appears exactly tp times.
    assert [c.dp_rank for c in coords] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {c.dp_size for c in coords} == {4}


def test_expert_parallel_coordinates_span_dp_shard_and_tp():
    dims = ParallelDims(world_size=8, dp_replicate=2, dp_shard=2, tp=2, ep=4)
    dims.validate(TINY_MOE)
    assert dims.efsdp == 1
    coords = [dims.coordinates(rank) for rank in range(8)]
    assert [c.ep for c in coords] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [c.efsdp for c in coords] == [0] * 8
    dims = ParallelDims(world_size=4, dp_shard=4, ep=2)
    assert [(dims.coordinates(r).efsdp, dims.coordinates(r).ep) for r in range(4)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]


def test_rank_outside_the_world_is_rejected():
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4 ranks"):
        ParallelDims(world_size=4).coordinates(4)


def test_coordinates_put_pp_outermost():
    """Pipeline stages are the outermost dim, so each stage's ranks are contiguous (a node)."""
    dims = ParallelDims(world_size=8, pp=2, dp_shard=2, tp=2)
    dims.validate(TINY)
    coords = [dims.coordinates(rank) for rank in range(8)]
    assert [c.pp for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    # PP peers (rank r and r + 4) share their data-parallel slot and TP coordinate.
    assert [c.dp_rank for c in coords] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [c.tp for c in coords] == [0, 1] * 4
    assert dims.dense_shape == (2, 1, 2, 1, 2)
    assert dims.sparse_shape == (2, 1, 4, 1)


def test_cp_sits_between_dp_shard_and_tp():
    """CP peers share the data-parallel slot; FSDP spans dp_shard x cp; experts all of it."""
    dims = ParallelDims(world_size=8, dp_shard=2, cp=2, tp=2, ep=4)
    dims.validate(TINY_MOE)
    coords = [dims.coordinates(rank) for rank in range(8)]
    assert [(c.dp_shard, c.cp, c.tp) for c in coords] == [
        (s, c, t) for s in range(2) for c in range(2) for t in range(2)
    ]
    assert [c.dp_rank for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims.fsdp_dims == ("dp_shard_cp",)
    assert ParallelDims(world_size=8, dp_replicate=2, cp=2).fsdp_dims == (
        "dp_replicate",
        "dp_shard_cp",
    )
    assert (dims.expert_ranks, dims.efsdp, dims.gradient_ranks) == (8, 2, 4)
