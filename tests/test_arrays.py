"""The pure parts of a sweep's job arrays (orchestrator/arrays.py): task lists, the limits' checks,
which task waits on which, the stuck tasks squeue names, and the dispatcher script run by bash
as SLURM runs it (tests/test_sweep_arrays.py queues real arrays)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from contract.job_env import array_task, job_id
from orchestrator.arrays import (
    ARRAYS_FILE,
    Link,
    Task,
    array_spec,
    check_limits,
    dispatcher_text,
    stuck_tasks,
    successor_of,
    task_ranges,
    write_arrays,
)
from orchestrator.errors import UsageError
from orchestrator.manifest import JobRecord


def test_task_ranges_are_sbatch_array_lists():
    assert task_ranges([0, 1, 2, 3]) == "0-3"
    assert task_ranges([5, 0, 1, 3, 9, 8, 7]) == "0-1,3,5,7-9"
    assert task_ranges([4]) == "4"
    assert array_spec([0, 1, 2], 2) == "0-2%2"
    assert array_spec([0, 1, 2], None) == "0-2"


def test_an_array_task_has_the_id_its_chain_records():
    assert job_id(
        {"SLURM_JOB_ID": "812", "SLURM_ARRAY_JOB_ID": "800", "SLURM_ARRAY_TASK_ID": "3"}
    ) == ("800_3")
    assert job_id({"SLURM_JOB_ID": "812"}) == "812"
    assert job_id({}) is None
    assert array_task("800_3") == ("800", "3")
    assert array_task("812") is None


def test_limits_are_refused_with_the_numbers():
    check_limits(200, 199, 600, {"MaxArraySize": 1001, "MaxJobCount": 10000, "queued": 5})
    with pytest.raises(UsageError, match="task ids up to 1001, and this cluster's MaxArraySize is"):
        check_limits(1002, 1001, 1002, {"MaxArraySize": 1001})
    with pytest.raises(
        UsageError, match=r"queues 600 tasks .* holds 9500 jobs: more than .* 10000"
    ):
        check_limits(200, 199, 600, {"MaxArraySize": 1001, "MaxJobCount": 10000, "queued": 9500})


def test_a_task_waits_on_its_own_member_s_task_only():
    waiting = JobRecord(index=1, seed=1, job_id="901_2", dependency="aftercorr:900")
    assert successor_of(waiting, "900_2")
    assert not successor_of(waiting, "900_3")  # another member's
    assert not successor_of(waiting, "899_2")  # another link's
    freed = JobRecord(index=1, seed=1, job_id="901_2", dependency="afterany:900_2")
    assert not successor_of(freed, "900_2")
    replacement = JobRecord(index=3, seed=1, job_id="950", dependency="afterany:901_2")
    assert not successor_of(replacement, "901_2")


def test_stuck_tasks_are_found_in_one_squeue_and_led_to_their_run_dirs(tmp_path):
    for member in (0, 1):
        (tmp_path / f"run{member}").mkdir()
        (tmp_path / "tasks").mkdir(exist_ok=True)
        (tmp_path / "tasks" / str(member)).symlink_to(tmp_path / f"run{member}")
    write_arrays(tmp_path / "tasks", "sweep", ["900", "901"])
    assert json.loads((tmp_path / "tasks" / ARRAYS_FILE).read_text())["arrays"] == ["900", "901"]
    asked = []

    def squeue(argv: list[str]) -> str:
        asked.append(argv)
        return "901_0|Dependency\n901_1|DependencyNeverSatisfied\n900_0|None\n"

    stuck = stuck_tasks(tmp_path / "tasks", squeue)
    assert stuck == {(tmp_path / "run1").resolve(): ["901_1"]}
    assert len(asked) == 1 and "--jobs" in asked[0] and "900,901" in asked[0]
    assert stuck_tasks(tmp_path / "nowhere", squeue) == {} and len(asked) == 1


def test_the_dispatcher_runs_the_member_s_script_with_its_own_quoted_values(tmp_path: Path):
    """Run by bash as SLURM runs it: task 1 enters its work dir and execs its member's script
    with its seed and arguments, each value exactly as given (spaces, quotes, $)."""
    script = tmp_path / "member.sub"
    script.write_text('#!/bin/bash\necho "$PWD|$1|$2|$ORCH_RUN_DIR|$ODD"\n')
    script.chmod(0o755)
    odd = 'it\'s a "value" with $HOME and spaces'
    tasks = tuple(
        Task(
            member=index,
            workdir=tmp_path,
            script=script,
            seed=100 + index,
            args=("an arg",),
            env={"ORCH_RUN_DIR": f"/runs/{index}", "ODD": odd},
        )
        for index in (0, 1)
    )
    header = ["#SBATCH --time=00:05:00", "#SBATCH --signal=B:USR1@60"]
    text = dispatcher_text(Link(0, "probe", header, tasks))
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --signal=B:USR1@60\n" in text
    dispatcher = tmp_path / "link-0.sub"
    dispatcher.write_text(text)

    def run(task: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": task}
        return subprocess.run(
            ["bash", str(dispatcher)], capture_output=True, text=True, env=env, cwd="/"
        )

    done = run("1")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{tmp_path}|101|an arg|/runs/1|{odd}\n"
    stray = run("7")
    assert stray.returncode == 2 and "task 7 is no member of this sweep" in stray.stderr
