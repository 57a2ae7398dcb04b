"""The submitit backend: chains of callables and scripts, locally and on the loopback cluster."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from contract.slurm_states import has_ended
from orchestrator.backends.base import JobRequest, JobStatus
from orchestrator.backends.submitit_common import SubmititBackendBase
from orchestrator.backends.submitit_local import SubmititLocalBackend
from orchestrator.backends.submitit_slurm import SubmititSlurmBackend
from orchestrator.errors import SchedulerError, UsageError
from tests.harness.chains import write_sub
from tests.harness.recorded_jobs import read_jsonl

# The jobs unpickle the callables below; by value, they need not import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHAIN_ID = "submitit-test-chain"
CONTRACT = ("ORCH_CHAIN_ID", "ORCH_JOB_INDEX", "ORCH_NUM_JOBS", "ORCH_SEED", "ORCH_RUN_DIR")


def record_job(seed: int, out: str, fail: bool = False, sleep_s: float = 0.0) -> int:
    """The test payload: one JSON line with what the job saw, then fail if asked."""
    start = time.time()
    time.sleep(sleep_s)
    seen = {name: os.environ.get(name) for name in CONTRACT}
    line = {"seed": seed, "start": start, "end": time.time(), "cwd": os.getcwd(), "env": seen}
    with open(out, "a") as stream:
        stream.write(json.dumps(line) + "\n")
    if fail:
        raise RuntimeError(f"job with seed {seed} fails on purpose")
    return seed


def seed_of(index: int) -> int:
    return 7919 * (index + 1)


def job_request(
    run_dir: Path,
    index: int,
    num_jobs: int,
    after: str | None,
    kind: str,
    function_args: tuple[Any, ...] = (),
    script: Path | None = None,
    script_args: tuple[str, ...] = (),
) -> JobRequest:
    return JobRequest(
        script=script,
        script_args=script_args,
        job_name="orch-submitit-test",
        log_pattern=run_dir / "unused-%j.out",
        env={
            "ORCH_CHAIN_ID": CHAIN_ID,
            "ORCH_JOB_INDEX": str(index),
            "ORCH_NUM_JOBS": str(num_jobs),
            "ORCH_SEED": str(seed_of(index)),
            "ORCH_RUN_DIR": str(run_dir),
        },
        dependency_kind=kind,
        after=after,
        workdir=run_dir,
        seed=seed_of(index),
        function=None if script is not None else record_job,
        function_args=function_args,
    )


def submit_chain(backend: SubmititBackendBase, requests: list[JobRequest]) -> list[str]:
    """Submit in order, each request waiting on the job before it (as the chain does)."""
    ids: list[str] = []
    for request in requests:
        after = ids[-1] if ids else None
        ids.append(backend.submit(dataclasses.replace(request, after=after)))
    return ids


def wait_finished(
    backend: SubmititBackendBase, ids: list[str], timeout_s: float
) -> list[JobStatus]:
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = backend.statuses(ids)
        if all(has_ended(statuses[job_id].state) for job_id in ids):
            return [statuses[job_id] for job_id in ids]
        assert time.monotonic() < deadline, f"jobs not finished after {timeout_s} s: {statuses}"
        time.sleep(0.5)


def assert_ran_in_order(lines: list[dict], indices: list[int], num_jobs: int, run_dir: Path):
    assert [int(line["env"]["ORCH_JOB_INDEX"]) for line in lines] == indices
    assert [line["seed"] for line in lines] == [seed_of(index) for index in indices]
    for line, index in zip(lines, indices, strict=True):
        assert line["env"] == {
            "ORCH_CHAIN_ID": CHAIN_ID,
            "ORCH_JOB_INDEX": str(index),
            "ORCH_NUM_JOBS": str(num_jobs),
            "ORCH_SEED": str(seed_of(index)),
            "ORCH_RUN_DIR": str(run_dir),
        }
    for earlier, later in itertools.pairwise(lines):
        assert later["start"] >= earlier["end"], "jobs overlapped"


@pytest.fixture
def local_backend(tmp_path: Path) -> SubmititLocalBackend:
    return SubmititLocalBackend(tmp_path / "submitit", executor_params={"timeout_min": 2})


# local cluster


def test_local_chain_of_a_callable_runs_in_order_with_seeds_and_env(local_backend, tmp_path):
    out = tmp_path / "jobs.jsonl"
    requests = [
        job_request(tmp_path, index, 3, None, "afterany", (str(out),)) for index in range(3)
    ]
    ids = submit_chain(local_backend, requests)
    assert len(set(ids)) == 3
    statuses = wait_finished(local_backend, ids, timeout_s=60)
    assert [status.state for status in statuses] == ["COMPLETED"] * 3
    assert [local_backend.result(job_id) for job_id in ids] == [seed_of(i) for i in range(3)]
    lines = read_jsonl(out)
    assert_ran_in_order(lines, [0, 1, 2], 3, tmp_path)
    assert {line["cwd"] for line in lines} == {str(tmp_path)}


def test_local_afterok_after_a_failed_job_runs_nothing_more(local_backend, tmp_path):
    out = tmp_path / "jobs.jsonl"
    requests = [job_request(tmp_path, 0, 3, None, "afterok", (str(out), True))] + [
        job_request(tmp_path, index, 3, None, "afterok", (str(out),)) for index in (1, 2)
    ]
    ids = submit_chain(local_backend, requests)
    statuses = wait_finished(local_backend, ids, timeout_s=60)
    assert [status.state for status in statuses] == ["FAILED", "CANCELLED", "CANCELLED"]
    assert "fails on purpose" in statuses[0].reason
    with pytest.raises(SchedulerError, match="fails on purpose"):
        local_backend.result(ids[0])
    assert [status.reason for status in statuses[1:]] == ["DependencyNeverSatisfied"] * 2
    assert_ran_in_order(read_jsonl(out), [0], 3, tmp_path)


def test_local_afterany_continues_after_a_failed_job(local_backend, tmp_path):
    out = tmp_path / "jobs.jsonl"
    requests = [
        job_request(tmp_path, 0, 2, None, "afterany", (str(out), True)),
        job_request(tmp_path, 1, 2, None, "afterany", (str(out),)),
    ]
    ids = submit_chain(local_backend, requests)
    statuses = wait_finished(local_backend, ids, timeout_s=60)
    assert [status.state for status in statuses] == ["FAILED", "COMPLETED"]
    assert_ran_in_order(read_jsonl(out), [0, 1], 2, tmp_path)


SIGNAL_BODY = """
trap 'echo "signalled $SEED $ORCH_JOB_INDEX $2" >> "$ORCH_RUN_DIR/script.log"; exit 0' USR1
sleep 30 &
wait
echo "not signalled" >> "$ORCH_RUN_DIR/script.log"
exit 1
"""


def test_local_script_gets_its_seed_args_env_and_signal(local_backend, tmp_path):
    # --time=1 with the signal 58 s before the end: the script hears USR1 about 2 s in.
    script = write_sub(tmp_path / "signal.sub", SIGNAL_BODY, "#SBATCH --time=1 --signal=B:USR1@58")
    request = job_request(tmp_path, 0, 1, None, "afterany", script=script, script_args=("x y",))
    job_id = local_backend.submit(request)
    [status] = wait_finished(local_backend, [job_id], timeout_s=30)
    assert status.state == "COMPLETED"
    assert (tmp_path / "script.log").read_text() == f"signalled {seed_of(0)} 0 x y\n"


CANCEL_BODY = """
sleep 60 &
echo $! > "$ORCH_RUN_DIR/child.pid"
wait
"""


def process_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_local_cancel_ends_the_job_and_everything_its_script_started(
    local_backend, tmp_path, sigint
):
    """Also when the submitting process ignores SIGINT, as a shell's background job or nohup
    does: the controller inherits that and ignores submitit's cancel (SIGINT), which left the
    job running in full-suite runs started with ``&``."""
    script = write_sub(tmp_path / "sleep.sub", CANCEL_BODY)
    request = job_request(tmp_path, 0, 1, None, "afterany", script=script)
    handler = signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler
    before = signal.signal(signal.SIGINT, handler)
    try:
        job_id = local_backend.submit(request)
    finally:
        signal.signal(signal.SIGINT, before)
    child = tmp_path / "child.pid"
    deadline = time.monotonic() + 20
    while not child.exists() or not child.read_text().strip():
        assert time.monotonic() < deadline, "the script never started"
        time.sleep(0.2)
    assert local_backend.statuses([job_id])[job_id].state == "RUNNING"
    local_backend.cancel([job_id])
    [status] = wait_finished(local_backend, [job_id], timeout_s=20)
    assert status.state == "CANCELLED"
    sleeper = int(child.read_text())
    deadline = time.monotonic() + 5
    while not process_gone(sleeper):
        assert time.monotonic() < deadline, "the script's child outlived the cancelled job"
        time.sleep(0.2)


def test_command_line_describes_the_submission(tmp_path):
    backend = SubmititSlurmBackend(tmp_path / "submitit")
    callable_request = job_request(tmp_path, 1, 2, None, "afterok", (str(tmp_path / "o"),))
    assert backend.command_line(callable_request, "41") == [
        "submitit",
        "slurm",
        "--job-name=orch-submitit-test",
        "--dependency=afterok:41",
        f"python:{__name__}.record_job",
        str(seed_of(1)),
        repr(str(tmp_path / "o")),
    ]
    script = write_sub(tmp_path / "a.sub", "true\n")
    script_request = job_request(
        tmp_path, 0, 2, None, "singleton", script=script, script_args=("a",)
    )
    assert backend.command_line(script_request, None)[2:] == [
        "--job-name=orch-submitit-test",
        "--dependency=singleton",
        "bash",
        str(script),
        str(seed_of(0)),
        "a",
    ]
    assert backend.test_only(script_request) is None


def test_bad_requests_are_refused_before_anything_runs(local_backend, tmp_path):
    request = job_request(tmp_path, 0, 1, None, "afterany", (str(tmp_path / "o"),))
    with pytest.raises(UsageError, match="afternotok"):
        local_backend.submit(dataclasses.replace(request, dependency_kind="afternotok"))
    with pytest.raises(UsageError, match="either a script or a Python callable"):
        local_backend.submit(dataclasses.replace(request, function=None))
    array = write_sub(tmp_path / "array.sub", "true\n", "#SBATCH --array=0-3")
    slurm_backend = SubmititSlurmBackend(tmp_path / "submitit")
    with pytest.raises(UsageError, match="job array"):
        slurm_backend.submit(job_request(tmp_path, 0, 1, None, "afterany", script=array))
    assert not (tmp_path / "o").exists()


# slurm cluster (the loopback cluster of tests/conftest.py)


def scontrol_fields(job_id: str) -> dict[str, str]:
    completed = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    )
    assert completed.returncode == 0, completed.stderr
    return dict(word.split("=", 1) for word in completed.stdout.split() if "=" in word)


SCRIPT_BODY = """
printf '{"seed": %s, "index": %s, "arg": "%s", "nodes": "%s", "job": "%s", "start": %s}\\n' \\
    "$SEED" "$ORCH_JOB_INDEX" "$2" "$SLURM_JOB_NUM_NODES" "$SLURM_JOB_ID" "$(date +%s.%N)" \\
    >> "$ORCH_RUN_DIR/script.jsonl"
srun bash -c 'echo "$SLURM_NODEID"' >> "$ORCH_RUN_DIR/nodes.$ORCH_JOB_INDEX"
"""
SCRIPT_DIRECTIVES = """
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:02:00
#SBATCH --signal=B:USR1@30
#SBATCH --job-name=ignored-for-the-chain-name
"""


@pytest.mark.slurm
def test_slurm_chains_of_a_callable_and_of_a_script(slurm_cluster, tmp_path):
    # 10 minutes: submitit warns 90 s before the limit, and SLURM's coarse check can deliver a
    # warning up to a minute early; a 2-minute limit put it at the jobs' very start.
    backend = SubmititSlurmBackend(tmp_path / "submitit", executor_params={"time": 10})
    callable_dir = tmp_path / "callable"
    script_dir = tmp_path / "script"
    callable_dir.mkdir()
    script_dir.mkdir()
    out = callable_dir / "jobs.jsonl"
    callable_ids = submit_chain(
        backend,
        [
            job_request(callable_dir, 0, 2, None, "afterany", (str(out), False, 2.0)),
            job_request(callable_dir, 1, 2, None, "afterany", (str(out),)),
        ],
    )
    # SLURM's own view of the dependency, while the first job is still busy.
    assert scontrol_fields(callable_ids[1])["Dependency"].startswith(f"afterany:{callable_ids[0]}")

    script = write_sub(script_dir / "two_nodes.sub", SCRIPT_BODY, SCRIPT_DIRECTIVES)
    script_ids = submit_chain(
        backend,
        [
            job_request(script_dir, index, 2, None, "afterok", script=script, script_args=("a b",))
            for index in range(2)
        ],
    )
    fields = scontrol_fields(script_ids[1])
    assert fields["Dependency"].startswith(f"afterok:{script_ids[0]}")
    assert fields["NumNodes"] in ("2", "2-2") and fields["TimeLimit"] == "00:02:00"
    assert fields["JobName"] == "orch-submitit-test"
    submission = (tmp_path / "submitit" / f"{script_ids[0]}_submission.sh").read_text()
    assert "#SBATCH --signal=B:USR1@30" in submission

    statuses = wait_finished(backend, callable_ids + script_ids, timeout_s=75)
    assert [status.state for status in statuses] == ["COMPLETED"] * 4

    lines = read_jsonl(out)
    assert_ran_in_order(lines, [0, 1], 2, callable_dir)
    assert {line["cwd"] for line in lines} == {str(callable_dir)}

    runs = read_jsonl(script_dir / "script.jsonl")
    assert [(run["index"], run["seed"], run["arg"]) for run in runs] == [
        (0, seed_of(0), "a b"),
        (1, seed_of(1), "a b"),
    ]
    assert [run["job"] for run in runs] == script_ids
    assert {run["nodes"] for run in runs} == {"2"}
    for index in range(2):
        assert sorted((script_dir / f"nodes.{index}").read_text().split()) == ["0", "1"]


SLURM_SIGNAL_BODY = """
trap 'echo "batch shell got USR1, seed $SEED" >> "$ORCH_RUN_DIR/signal.log"; exit 0' USR1
sleep 90 &
wait
"""


@pytest.mark.slurm
def test_slurm_script_hears_its_batch_signal(slurm_cluster, tmp_path):
    # B: signals go to the batch shell only; the python running the script replaces that shell
    # and forwards the signal. The signal is due 20 s in (long after the trap is set: one due at
    # start raced the script's start-up) and SLURM checks limits every ~30 s, so it comes by 50 s.
    script = write_sub(
        tmp_path / "signal.sub", SLURM_SIGNAL_BODY, "#SBATCH --time=2 --signal=B:USR1@100"
    )
    backend = SubmititSlurmBackend(tmp_path / "submitit")
    job_id = backend.submit(job_request(tmp_path, 0, 1, None, "afterany", script=script))
    [status] = wait_finished(backend, [job_id], timeout_s=110)
    assert status.state == "COMPLETED"
    assert (tmp_path / "signal.log").read_text() == f"batch shell got USR1, seed {seed_of(0)}\n"
