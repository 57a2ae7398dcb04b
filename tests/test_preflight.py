"""The preflight against sinfo's partition table, without a cluster (pure functions)."""

from __future__ import annotations

import pytest

from orchestrator.errors import UsageError
from orchestrator.slurm.partitions import check_partition, parse_partitions
from orchestrator.slurm.resources import JobResources

TABLE = (
    "debug*|up|2|4|(null)|infinite|1\n"
    "maint|down|4|8|gpu:2|1-00:00:00|64000\n"
    "old|drain|1|4|(null)|30|1\n"
    "hopper|up|2|64|gpu:h100:8(S:0-1)|2-00:00:00|2000000+\n"
)


@pytest.mark.parametrize("name", ["maint", "old"])
def test_a_partition_down_or_drained_only_warns(name: str, capsys) -> None:
    partition = check_partition(JobResources(partition=name), parse_partitions(TABLE))
    assert partition.name == name
    warning = capsys.readouterr().err
    assert warning.startswith("warning: ") and name in warning and "pend" in warning


def test_an_up_partition_says_nothing(capsys) -> None:
    assert check_partition(JobResources(), parse_partitions(TABLE)).name == "debug"
    assert capsys.readouterr().err == ""


def test_a_partition_that_does_not_exist_is_an_error() -> None:
    with pytest.raises(UsageError, match=r"partition 'gpu' does not exist.*debug, maint, old"):
        check_partition(JobResources(partition="gpu"), parse_partitions(TABLE))


def test_a_down_partition_is_still_checked_for_size() -> None:
    with pytest.raises(UsageError, match="3 GPUs per node asked"):
        resources = JobResources(partition="maint", gpus_per_node=3)
        check_partition(resources, parse_partitions(TABLE))


def test_sinfo_gives_node_memory_and_gpu_type() -> None:
    partitions = {p.name: p for p in parse_partitions(TABLE)}
    assert partitions["hopper"].gpu_type == "h100"
    assert partitions["hopper"].gpus_per_node == 8
    assert partitions["hopper"].memory_mb == 2_000_000
    assert partitions["maint"].gpu_type is None
    assert partitions["debug"].memory_mb == 1
