"""Pipeline plans: schedules, microbatches and stage splits, checked without any process group."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from train.config import register
from train.models.presets import get_preset
from train.parallel.layout import parallel_dims, pipeline_for
from train.parallel.pipeline_plan import balanced_split, pipeline_plan, plan_pipeline

BLOCKS = [10] * 8


def test_balanced_split_gives_the_heavy_ends_fewer_blocks():
    assert balanced_split(BLOCKS, 2, 0, 0) == (4, 4)
    # The first stage carries the encoder (30), the last the head (10): no stage above 40.
    split = balanced_split(BLOCKS, 4, 30, 10)
    assert split[0] == 1 and sum(split) == 8 and max(split[1:-1]) <= 4 and split[-1] <= 3
    assert balanced_split([5, 1, 1, 1, 5], 3, 0, 0) == (1, 3, 1)


def test_every_stage_gets_a_block():
    assert balanced_split([1, 1, 100], 3, 0, 0) == (1, 1, 1)
    with pytest.raises(ValueError, match="cannot split 2 blocks into 3"):
        balanced_split([1, 1], 3, 0, 0)


def test_defaults_and_stage_placement():
    plan = plan_pipeline(2, "1f1b", 0, 0, [], BLOCKS, 0, 0)
    assert (plan.microbatches, plan.stages_per_rank, plan.num_stages) == (4, 1, 2)
    interleaved = plan_pipeline(2, "interleaved_1f1b", 4, 0, [], BLOCKS, 0, 0)
    assert interleaved.split == (2, 2, 2, 2)
    assert interleaved.local_stages(0) == [0, 2]
    assert interleaved.local_stages(1) == [1, 3]
    assert list(interleaved.stage_blocks(2)) == [4, 5]
    explicit = plan_pipeline(2, "gpipe", 1, 1, [3, 5], BLOCKS, 0, 0)
    assert explicit.split == (3, 5)
    assert "stage 0 on pp rank 0: encoder+projector+embeddings, blocks 0-2" in explicit.describe()
    assert "stage 1 on pp rank 1: blocks 3-7, norm+head+loss" in explicit.describe()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, "pipedream", 0, 0, []), "parallel.pp_schedule='pipedream' is unknown"),
        ((2, "zero_bubble", 4, 0, []), "zero_bubble is not supported by this torch"),
        ((2, "1f1b", 1, 0, []), "parallel.pp_microbatches=1 is fewer than pp=2"),
        ((2, "interleaved_1f1b", 5, 0, []), "does not suit interleaved_1f1b at pp=2"),
        ((2, "1f1b", 4, 2, []), "runs one stage per rank"),
        ((4, "interleaved_1f1b", 8, 3, []), "12 stages, but the model has 8 LLM blocks"),
        ((3, "interleaved_1f1b", 3, 2, []), "needs the 8 LLM blocks to divide evenly"),
        ((2, "1f1b", 2, 1, [4, 3]), "parallel.pp_split=[4, 3] must give 2 positive block counts"),
    ],
)
def test_bad_settings_name_the_setting(args, message):
    with pytest.raises(ValueError) as err:
        plan_pipeline(*args, BLOCKS, 0, 0)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_model_plan_weighs_stages_by_parameters():
    plan = pipeline_plan(get_preset("tiny_deep"), 2, "1f1b", 0, 0, [])
    # The tiny model's encoder outweighs two LLM blocks: stage 0 keeps a single block.
    assert plan.split == (1, 3)


@pytest.mark.parametrize(
    ("config", "world", "describe"),
    [
        ("tiny_pp", 2, "stage 1 on pp rank 1: blocks 1-1, norm+head+loss"),
        ("gpu_llm_1b_pp", 16, "pipeline 1f1b, 8 microbatches"),
    ],
)
def test_shipped_pipeline_configs_plan_at_their_size(config, world, describe):
    """The recipes' configs compose and their layouts pass every check before queueing."""
    register()
    with initialize_config_module("recipes.conf", version_base=None):
        cfg = OmegaConf.to_object(compose(config_name=config))
    dims = parallel_dims(cfg, world)
    assert dims.pp == 2
    assert describe in pipeline_for(cfg, dims).describe()
