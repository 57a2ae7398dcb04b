"""Daemons of a loopback cluster dying under a queue: SLURM notices within seconds, `cluster up`
restarts only what died without losing a job, and `orchestrator status` answers meanwhile.

These tests kill daemons, so they run on a cluster of their own (with accounting, as the session
cluster), started once for the module: the session cluster stays healthy for the other tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from contract.slurm_states import END_STATES
from orchestrator import cluster
from orchestrator.slurm.commands import QUERY_TIMEOUT_S
from tests.harness.chains import write_sub
from tests.harness.cluster import SESSION_ENV, cluster_cli
from tests.harness.process import run_tool

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Job 0 holds its nodes long enough for a daemon to be killed under it; later jobs are quick.
BODY = """
echo "job $ORCH_JOB_INDEX on $SLURMD_NODENAME"
if [ "$ORCH_JOB_INDEX" = 0 ]; then sleep "$HOLD_S"; fi
echo "[orch] training exited with status 0"
"""


@dataclass(frozen=True)
class Faulty:
    directory: str
    env: dict[str, str]  # points SLURM's commands at this cluster


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    """A 2-node cluster with accounting, owned by this session like the session cluster."""
    directory = tmp_path_factory.mktemp("faults")
    env = {**os.environ, SESSION_ENV: str(os.getpid())}
    shape = ("--nodes", "2", "--cpus-per-node", "2", "--accounting")
    started = cluster_cli("up", *shape, "--dir", str(directory), env=env)
    assert started.returncode == 0, started.stderr
    try:
        yield Faulty(str(directory), {"SLURM_CONF": str(directory / cluster.CONF_NAME)})
    finally:
        stopped = cluster_cli("down", "--dir", str(directory))
        assert stopped.returncode == 0, stopped.stderr


def slurm(env: dict[str, str], *argv: str) -> str:
    completed = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=30, env={**os.environ, **env}
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def queue(env: dict[str, str]) -> dict[str, str]:
    """Job id -> state of the jobs in the queue."""
    output = slurm(env, "squeue", "--noheader", "--format=%i %T")
    return dict(line.split() for line in output.splitlines() if line.strip())


def exited(pid: int) -> bool:
    """Whether the process ``pid`` has ended (gone, or a zombie left for its parent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def accounted(env: dict[str, str], job_id: str) -> str:
    """The job's state in accounting (sacct), empty while it has no record."""
    return slurm(env, "sacct", "-X", "-n", "-P", "-j", job_id, "--format=State").strip()


def wait_for(what: str, check, timeout: float = 60) -> float:
    """Poll ``check()`` until it is true; the seconds it took."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"{what}: not after {timeout} s"
        time.sleep(0.5)
    return time.monotonic() - started


def status_json(env: dict[str, str], chain: str) -> dict:
    completed = run_tool("orchestrator", "status", chain, "--json", env=env, timeout=60)
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def timed_status(env: dict[str, str], chain: str) -> tuple[dict, float]:
    """``status_json`` and the seconds it took."""
    started = time.monotonic()
    status = status_json(env, chain)
    return status, time.monotonic() - started


def status_bound(healthy_s: float) -> float:
    """How long status may take with a daemon down, from how long it took on the healthy
    cluster just before, under the same load: its queries again (twice as slow, say) plus one
    query's timeout for the daemon that does not answer, never a retry loop's minutes."""
    return 2 * healthy_s + QUERY_TIMEOUT_S


def save_controller_state(env: dict[str, str], directory: str, job_id: str) -> None:
    """Make slurmctld save its job state, and wait until it has: a SIGKILLed controller recovers
    what it saved last, which on its own it does only every few seconds (a SLURM limitation,
    on real clusters too). A job update asks for a save; the state file's time says it is done
    (less a file-clock tick: file times lag the wall clock by a few ms)."""
    state = Path(directory) / "state" / "job_state"
    asked = time.time() - 0.05
    slurm(env, "scontrol", "update", f"JobId={job_id}", "Comment=state-saved")
    wait_for(
        "slurmctld's job state saved", lambda: state.exists() and state.stat().st_mtime > asked
    )


def launch(env: dict[str, str], tmp_path: Path, num_jobs: int, nodes: int, hold_s: int) -> dict:
    recipe = write_sub(
        tmp_path / "hold.sub", BODY, f"#SBATCH --time=00:05:00\n#SBATCH --nodes={nodes}"
    )
    run_dir = str(tmp_path / "run")
    completed = run_tool(
        "auto_launch",
        "--json",
        f"-n{num_jobs}",
        "--run-dir",
        run_dir,
        str(recipe),
        env={**env, "HOLD_S": str(hold_s)},
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def wait_chain(env: dict[str, str], chain: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = status_json(env, chain)
        if all(job["state"] in END_STATES for job in status["jobs"]):
            return status
        assert time.monotonic() < deadline, f"chain not finished after {timeout} s: {status}"
        time.sleep(1)


def test_a_dead_slurmd_is_noticed_and_restarted_alone(faulty: Faulty, tmp_path: Path) -> None:
    directory, env = faulty.directory, faulty.env
    summary = launch(env, tmp_path, num_jobs=2, nodes=2, hold_s=120)  # ended by the node's death
    first, second = (job["job_id"] for job in summary["jobs"])
    wait_for("job 0 running", lambda: queue(env).get(first) == "RUNNING")
    before = cluster.daemon_pids(directory)

    os.kill(before["slurmd-n1"], signal.SIGKILL)
    took = wait_for(
        "n1 marked down",
        lambda: cluster.node_states(env["SLURM_CONF"]).get("n1", "").startswith("down"),
    )
    assert took < 30, f"a dead slurmd took {took:.0f} s to be noticed"
    # Job 0 lost a node; job 1 needs both nodes, so it waits for n1.
    wait_for("job 0 gone from the queue", lambda: first not in queue(env))
    assert queue(env)[second] == "PENDING"

    again = cluster_cli("up", "--dir", directory)
    assert again.returncode == 0, again.stderr
    assert "restarting slurmd-n1;" in again.stderr
    after = cluster.daemon_pids(directory)
    assert after["slurmd-n1"] not in (None, before["slurmd-n1"])
    assert {k: v for k, v in after.items() if k != "slurmd-n1"} == {
        k: v for k, v in before.items() if k != "slurmd-n1"
    }

    final = wait_chain(env, summary["chain_id"])
    job0, job1 = final["jobs"]
    assert (job0["state"], job0["source"], job0["nodes"]) == ("NODE_FAIL", "sacct", "n[1-2]")
    assert job0["elapsed"] not in ("", "00:00:00")
    # Accounting hears of a job's end a moment after the controller: either may answer.
    assert (job1["state"], job1["exit_code"]) == ("COMPLETED", 0)
    assert job1["source"] in ("sacct", "scontrol"), job1


def test_a_dead_slurmctld_keeps_its_queue_and_status_answers_meanwhile(
    faulty: Faulty, tmp_path: Path
) -> None:
    directory, env = faulty.directory, faulty.env
    summary = launch(env, tmp_path, num_jobs=3, nodes=1, hold_s=30)  # outlives the restart
    ids = [job["job_id"] for job in summary["jobs"]]
    wait_for("job 0 running", lambda: queue(env).get(ids[0]) == "RUNNING")
    # slurmctld tells slurmdbd of the start on its own time: under load, seconds later.
    wait_for("accounting knows job 0 runs", lambda: accounted(env, ids[0]) == "RUNNING")
    _, healthy_s = timed_status(env, summary["chain_id"])
    save_controller_state(env, directory, ids[0])
    before = cluster.daemon_pids(directory)
    os.kill(before["slurmctld"], signal.SIGKILL)

    status, took = timed_status(env, summary["chain_id"])
    assert took < status_bound(healthy_s), (
        f"status took {took:.1f} s with the controller gone, {healthy_s:.1f} s with it up"
    )
    assert "DOWN" in status["controller_unreachable"]
    # Accounting answers without the controller.
    assert [(job["state"], job["source"]) for job in status["jobs"]] == [
        ("RUNNING", "sacct"),
        ("PENDING", "sacct"),
        ("PENDING", "sacct"),
    ]
    text = run_tool("orchestrator", "status", summary["chain_id"], env=env, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "SLURM controller unreachable" in text.stdout

    # A new shape would need a new cluster: refused, the saved queue untouched.
    refused = cluster_cli("up", "--nodes", "3", "--dir", directory)
    assert refused.returncode == 2
    assert "cluster down" in refused.stderr and "state" in refused.stderr

    again = cluster_cli("up", "--dir", directory)
    assert again.returncode == 0, again.stderr
    assert "restarting slurmctld;" in again.stderr
    after = cluster.daemon_pids(directory)
    assert after["slurmctld"] not in (None, before["slurmctld"])
    assert {k: v for k, v in after.items() if k != "slurmctld"} == {
        k: v for k, v in before.items() if k != "slurmctld"
    }
    assert set(ids) <= set(queue(env))
    fields = slurm(env, "scontrol", "show", "job", "-o", ids[2])
    assert f"Dependency=afterany:{ids[1]}" in fields

    final = wait_chain(env, summary["chain_id"])
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 3


def test_dead_accounting_daemons_are_restarted(faulty: Faulty) -> None:
    directory, env = faulty.directory, faulty.env
    job_id = slurm(env, "sbatch", "--parsable", "--output=/dev/null", "--wrap", "true").strip()
    before = cluster.daemon_pids(directory)
    for daemon in ("slurmdbd", "mariadbd"):
        os.kill(before[daemon], signal.SIGKILL)
    wait_for("slurmdbd gone", lambda: cluster.daemon_pids(directory)["slurmdbd"] is None)

    again = cluster_cli("up", "--dir", directory)
    assert again.returncode == 0, again.stderr
    assert "restarting mariadbd, slurmdbd;" in again.stderr
    after = cluster.daemon_pids(directory)
    assert after["slurmctld"] == before["slurmctld"]

    wait_for("the job in accounting", lambda: accounted(env, job_id) == "COMPLETED", timeout=30)


def test_status_answers_while_accounting_is_down(faulty: Faulty, tmp_path: Path) -> None:
    """slurmdbd stopped under a finished chain: status still reads the jobs (from scontrol, which
    remembers them for MinJobAge) and says once that accounting is unreachable; `cluster up`
    restarts slurmdbd alone and sacct answers again."""
    directory, env = faulty.directory, faulty.env
    chain = launch(env, tmp_path, num_jobs=2, nodes=1, hold_s=0)["chain_id"]
    wait_chain(env, chain)
    _, healthy_s = timed_status(env, chain)
    slurmdbd = cluster.daemon_pids(directory)["slurmdbd"]
    os.kill(slurmdbd, signal.SIGTERM)
    try:
        # Its pid file goes first; the process may answer a little longer.
        wait_for("slurmdbd stopped", lambda: exited(slurmdbd))
        status, took = timed_status(env, chain)
        assert took < status_bound(healthy_s), (
            f"status took {took:.1f} s with accounting gone, {healthy_s:.1f} s with it up"
        )
        assert status["controller_unreachable"] is None
        assert "Connection refused" in (status["accounting_unreachable"] or ""), status
        assert [(job["state"], job["exit_code"], job["source"]) for job in status["jobs"]] == [
            ("COMPLETED", 0, "scontrol")
        ] * 2
        text = run_tool("orchestrator", "status", chain, env=env, timeout=60)
        assert text.returncode == 0, text.stderr
        notices = [line for line in text.stdout.splitlines() if "unreachable" in line]
        assert len(notices) == 1, text.stdout
        assert notices[0].startswith("accounting (slurmdbd) unreachable ("), text.stdout
    finally:
        again = cluster_cli("up", "--dir", directory)
    assert again.returncode == 0, again.stderr
    assert "restarting slurmdbd;" in again.stderr

    def accounted() -> bool:
        status = status_json(env, chain)
        sources = [job["source"] for job in status["jobs"]]
        return status["accounting_unreachable"] is None and sources == ["sacct", "sacct"]

    wait_for("the chain read from accounting again", accounted, timeout=30)
