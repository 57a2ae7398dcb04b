"""The loopback cluster: it runs real multi-node jobs, and `down` leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator import processes
from orchestrator.cluster.daemons import daemon_pids, marked_pids, running_clusters
from orchestrator.cluster.queries import node_states
from orchestrator.cluster.record import CONF_NAME
from tests.harness.cluster import (
    SESSION_ENV,
    LoopbackCluster,
    cluster_cli,
    down_clusters_of_dead_sessions,
)

pytestmark = pytest.mark.slurm


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return dict(word.split("=", 1) for word in out.split() if "=" in word)


def wait_state(job_id: str, states: set[str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while (state := job_fields(job_id)["JobState"]) not in states:
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout} s"
        time.sleep(0.5)
    return state


def sbatch(*args: str) -> str:
    completed = subprocess.run(
        ["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=30
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.strip()


def live_processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in argv:
                found.append(f"{entry.name}: {argv}")
    return found


def test_nodes_are_idle(empty_queue: LoopbackCluster) -> None:
    assert node_states(empty_queue.conf) == {"n1": "idle", "n2": "idle"}


def test_two_node_job_runs_one_task_on_each_node(
    empty_queue: LoopbackCluster, tmp_path: Path
) -> None:
    out = tmp_path / "out.txt"
    job_id = sbatch(
        "--nodes=2",
        f"--output={out}",
        "--wrap",
        "srun bash -c 'echo $SLURM_NODEID $SLURMD_NODENAME'",
    )
    assert wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", out.read_text()
    assert sorted(out.read_text().split("\n")[:2]) == ["0 n1", "1 n2"]
    # Finished jobs leave the queue but stay visible to scontrol (MinJobAge).
    assert job_id not in empty_queue.queue_job_ids()
    assert job_fields(job_id)["ExitCode"] == "0:0"


def test_env_prints_the_conf_and_the_conf_uses_absolute_paths(
    slurm_cluster: LoopbackCluster,
) -> None:
    shown = cluster_cli("env", "--dir", str(slurm_cluster.directory))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == f"export SLURM_CONF={slurm_cluster.conf}\n"
    settings = dict(
        line.split("=", 1)
        for line in slurm_cluster.conf.read_text().splitlines()
        if line and not line.startswith("#") and " " not in line
    )
    paths = {key: value for key, value in settings.items() if key.endswith(("File", "Dir"))}
    paths["StateSaveLocation"] = settings["StateSaveLocation"]
    assert len(paths) == 6
    for key, value in paths.items():
        assert value.startswith(f"{slurm_cluster.directory}/"), (key, value)


def test_status_shows_conf_daemons_pids_and_nodes(empty_queue: LoopbackCluster) -> None:
    shown = cluster_cli("status", "--dir", str(empty_queue.directory))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert f"conf:    {empty_queue.conf}" in lines
    assert any(line.startswith("accounting: slurmdbd on 127.0.0.1:") for line in lines)
    for daemon in ("mariadbd", "slurmdbd", "slurmctld", "slurmd-n1", "slurmd-n2"):
        pid = (empty_queue.directory / "pid" / f"{daemon}.pid").read_text().strip()
        assert any(line.split()[:4] == [daemon, "pid", pid, "alive"] for line in lines), daemon
    for node in ("n1", "n2"):
        assert any(line.split()[:2] == [node, "idle"] for line in lines), node


def test_up_again_finds_the_running_cluster(slurm_cluster: LoopbackCluster) -> None:
    before = daemon_pids(slurm_cluster.directory)
    again = cluster_cli("up", "--dir", str(slurm_cluster.directory))
    assert again.returncode == 0, again.stderr
    assert "already running" in again.stderr
    assert daemon_pids(slurm_cluster.directory) == before


def test_up_down_cycle_leaves_nothing_behind(
    slurm_cluster: LoopbackCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory = tmp_path_factory.mktemp("cycle")
    conf = directory / CONF_NAME
    started = cluster_cli("up", "--nodes", "1", "--dir", str(directory))
    assert started.returncode == 0, started.stderr

    # A controller that died is restarted alone; the node daemon keeps running.
    before = daemon_pids(directory)
    dead_pid = before["slurmctld"]
    assert dead_pid is not None and set(before) == {"slurmctld", "slurmd-n1"}
    os.kill(dead_pid, signal.SIGKILL)
    restarted = cluster_cli("up", "--nodes", "1", "--dir", str(directory))
    assert restarted.returncode == 0, restarted.stderr
    assert "restarting slurmctld;" in restarted.stderr
    daemons = daemon_pids(directory)
    assert None not in daemons.values() and dead_pid not in daemons.values()
    assert daemons["slurmd-n1"] == before["slurmd-n1"]

    # A job still running at `down` time must go too (its script lives in the spool dir).
    env = {**os.environ, "SLURM_CONF": str(conf)}
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--output=/dev/null", "--wrap", "sleep 300"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=True,
    ).stdout.strip()
    deadline = time.monotonic() + 30
    while not live_processes_mentioning(f"{directory}/spool/n1/job"):
        assert time.monotonic() < deadline, f"job {job_id} never started"
        time.sleep(0.5)
    started_pids = processes.with_descendants([*daemons.values(), *marked_pids(directory)])
    assert len(started_pids) >= 5  # slurmctld, slurmscriptd, slurmd, slurmstepd, the job

    stopped = cluster_cli("down", "--dir", str(directory))
    assert stopped.returncode == 0, stopped.stderr
    assert [pid for pid in started_pids if processes.alive(pid)] == []
    assert live_processes_mentioning(str(directory)) == []
    assert sorted(path.name for path in directory.iterdir()) == ["log"]
    assert (directory / "log" / "slurmctld.log").is_file()

    again = cluster_cli("down", "--dir", str(directory))
    assert again.returncode == 0, again.stderr
    assert "nothing to stop" in again.stderr
    # The session cluster (and the munged it shares) is untouched.
    assert node_states(slurm_cluster.conf).keys() == {"n1", "n2"}


def test_clusters_of_killed_sessions_are_stopped(
    slurm_cluster: LoopbackCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    directory = tmp_path_factory.mktemp("orphan")
    env = {**os.environ, SESSION_ENV: str(dead.pid)}
    started = cluster_cli("up", "--nodes", "1", "--dir", str(directory), env=env)
    assert started.returncode == 0, started.stderr
    assert directory in running_clusters()

    down_clusters_of_dead_sessions()
    running = running_clusters()
    assert directory not in running
    assert slurm_cluster.directory in running  # its owner, this session, is alive


def test_env_on_a_dir_without_cluster_exits_2(tmp_path: Path) -> None:
    shown = cluster_cli("env", "--dir", str(tmp_path))
    assert shown.returncode == 2
    assert shown.stdout == ""
    assert f"no cluster in {tmp_path}" in shown.stderr
    assert "orchestrator cluster up" in shown.stderr


def test_up_with_another_shape_refuses_and_names_the_queued_jobs(
    empty_queue: LoopbackCluster,
) -> None:
    held = sbatch("--hold", "--output=/dev/null", "--wrap", "true")
    try:
        changed = cluster_cli("up", "--nodes", "3", "--dir", str(empty_queue.directory))
        assert changed.returncode == 2, changed.stderr
        assert f"{held} PENDING" in changed.stderr
        assert f"orchestrator cluster down --dir {empty_queue.directory}" in changed.stderr
        assert empty_queue.queue_job_ids() == [held]
    finally:
        subprocess.run(["scancel", held], timeout=30, check=True)
