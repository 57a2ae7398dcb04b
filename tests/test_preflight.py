"""The preflight against sinfo's partition table, without a cluster (pure functions)."""

from __future__ import annotations

import pytest

from orchestrator.errors import UsageError
from orchestrator.preflight import check_resources, parse_partitions

TABLE = "debug*|up|2|4|(null)|infinite\nmaint|down|4|8|gpu:2|1-00:00:00\nold|drain|1|4|(null)|30\n"


@pytest.mark.parametrize("name", ["maint", "old"])
def test_a_partition_down_or_drained_only_warns(name: str, capsys) -> None:
    partition = check_resources({"partition": name}, parse_partitions(TABLE))
    assert partition.name == name
    warning = capsys.readouterr().err
    assert warning.startswith("warning: ") and name in warning and "pend" in warning


def test_an_up_partition_says_nothing(capsys) -> None:
    assert check_resources({}, parse_partitions(TABLE)).name == "debug"
    assert capsys.readouterr().err == ""


def test_a_partition_that_does_not_exist_is_an_error() -> None:
    with pytest.raises(UsageError, match=r"partition 'gpu' does not exist.*debug, maint, old"):
        check_resources({"partition": "gpu"}, parse_partitions(TABLE))


def test_a_down_partition_is_still_checked_for_size() -> None:
    with pytest.raises(UsageError, match="3 GPUs per node asked"):
        check_resources({"partition": "maint", "gpus-per-node": "3"}, parse_partitions(TABLE))
