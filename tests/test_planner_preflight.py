"""The planner as a preflight on the loopback cluster: a training layout that cannot fit is
refused before anything is queued, and ``--no-plan-check`` lets it through."""

from __future__ import annotations

import pytest

from orchestrator.errors import UsageError
from orchestrator.planner.cluster import GIB
from orchestrator.planner.plan_check import (
    Capacity,
    capacity_for,
    check_training_fits,
    compose_training_config,
    request_and_layout,
    train_arguments,
)
from orchestrator.planner.search import pipeline_for as search_pipeline
from orchestrator.planner.search import priced_inventory
from orchestrator.slurm.partitions import parse_partitions
from tests.harness.cluster import queue_ids, wait_gone
from tests.harness.process import REPO, run_tool
from train.parallel.dims import ParallelDims, sequence_multiple
from train.parallel.layout import parallel_dims, pipeline_for

# Too big for any host: an hour of audio per batch through the 1B-parameter LLM. The missing
# corpus makes a job that gets through (--no-plan-check) fail at once, harmlessly.
TOO_BIG = ("model.preset=llm_1b", "data.max_duration=3600", "data.corpus=/nonexistent/corpus")


@pytest.mark.slurm
def test_a_layout_that_cannot_fit_is_refused_with_nothing_queued(empty_queue, tmp_path):
    """Refused on the login node without torch: the check composes the trainer's config and
    prices its layout with torch-free modules (``-X importtime`` lists what was imported), and
    loads neither numpy nor submitit, which the launch does not use."""
    done = run_tool(
        "auto_launch",
        "-n3",
        "--run-dir",
        str(tmp_path / "run"),
        "recipes/train_tiny_fsdp2.yaml",
        "--",
        *TOO_BIG,
        cwd=REPO,
        env={"PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert done.returncode == 2, done.stderr + done.stdout
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "orchestrator.planner.plan_check" in imported and "train.config" in imported
    # Nor what the submit path does not use (launch cost: submitit ~0.14 s, numpy ~0.13 s).
    heavy = {"torch", "numpy", "submitit", "lhotse"}
    assert not [name for name in imported if name.split(".")[0] in heavy]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert "error: plan check: " in errors[0]
    assert "needs " in errors[0] and "GiB per rank" in errors[0]
    assert "of host memory" in errors[0] and "--no-plan-check" in errors[0]
    assert queue_ids() == []
    assert not (tmp_path / "run").exists()


@pytest.mark.slurm
def test_no_plan_check_lets_the_chain_through(empty_queue, tmp_path):
    done = run_tool(
        "auto_launch",
        "-n2",
        "--no-plan-check",
        "--json",
        "--run-dir",
        str(tmp_path / "run"),
        "recipes/train_tiny_fsdp2.yaml",
        "--",
        *TOO_BIG,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    jobs = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert jobs, done.stdout
    run_tool("orchestrator", "cancel", str(tmp_path / "run"))
    wait_gone(queue_ids())


def test_a_gpu_recipe_is_checked_against_its_gpu():
    cfg = compose_training_config(["--config-name", "gpu_llm_1b"])
    h100 = capacity_for(8, 8, "h100", None)
    assert h100 is not None and h100.bytes_per_rank == 80 * GIB
    fits = check_training_fits(cfg, 1, 8, h100, "gpu_llm_1b")
    assert fits.fits
    tiny = Capacity(2 * GIB, "a 2 GiB GPU", h100.gpu)
    with pytest.raises(UsageError, match=r"the best layout that fits: |no layout of 8"):
        check_training_fits(cfg, 1, 8, tiny, "gpu_llm_1b")


def test_gpu_memory_comes_from_the_partition_when_the_recipe_names_no_gpu():
    (partition,) = parse_partitions("gpu*|up|4|64|gpu:a100:8|2-00:00:00|1000000\n")
    capacity = capacity_for(8, 8, None, partition)
    assert capacity.gpu.key == "a100" and "partition gpu" in capacity.where
    (unknown,) = parse_partitions("gpu*|up|4|64|gpu:8|2-00:00:00|1000000\n")
    assert capacity_for(8, 8, None, unknown) is None  # skipped, with a line saying so


def test_cpu_ranks_share_the_node_memory():
    (partition,) = parse_partitions("cpu*|up|4|64|(null)|infinite|64000\n")
    capacity = capacity_for(0, 4, None, partition)
    assert capacity.gpu is None
    assert capacity.bytes_per_rank == 64000 * 2**20 / 4


def test_only_the_trainer_command_is_checked():
    assert train_arguments(["python", "-m", "train", "--config-name", "x"]) == [
        "--config-name",
        "x",
    ]
    assert train_arguments(["python", "recipes/smoke.py", "${SEED}"]) is None


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["parallel.pp_split=[3,1]"],
        ["parallel.pp_schedule=gpipe", "parallel.pp_microbatches=3"],
        ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_microbatches=4"],
        [
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_stages_per_rank=3",
            "parallel.pp_split=[1,1,1,1,1,1]",
            "model.preset=tiny_layouts",
        ],
    ],
    ids=["balanced", "pp_split", "gpipe", "interleaved", "interleaved_split"],
)
def test_the_plan_check_prices_the_pipeline_the_trainer_runs(overrides):
    """The planner's stages, schedule and microbatches are the trainer's own (it used to price
    a balanced 1F1B split whatever the config said), and its rank parts follow the looped
    placement of several stages per rank."""
    cfg = compose_training_config(
        ["--config-name", "tiny_pp", "model.preset=tiny_deep", *overrides]
    )
    capacity = Capacity(64 * GIB, "a test host", None)
    request, layout = request_and_layout(cfg, 1, 2, capacity)
    trainer_plan = pipeline_for(cfg, parallel_dims(cfg, 2))
    _, counts, _ = priced_inventory(request)
    assert search_pipeline(counts, layout, {}) == trainer_plan
    assert layout.microbatches == trainer_plan.microbatches
    assert check_training_fits(cfg, 1, 2, capacity, "tiny_pp").fits


@pytest.mark.parametrize(
    ("tp", "cp", "multiple"), [(1, 1, 8), (2, 1, 8), (4, 1, 8), (3, 1, 24), (2, 2, 8), (2, 4, 16)]
)
def test_planner_and_trainer_pad_sequences_alike(tp, cp, multiple):
    """One rule (lcm, not product: at tp=2 both pad to 8, where the planner once said 16)."""
    dims = ParallelDims(world_size=tp * cp, tp=tp, cp=cp)
    assert dims.seq_multiple == sequence_multiple(tp, cp) == multiple
