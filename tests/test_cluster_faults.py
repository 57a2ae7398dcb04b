"""Daemons of a loopback cluster dying under a queue: SLURM notices within seconds, `cluster up`
restarts only what died without losing a job, and `orchestrator status` answers meanwhile.

These tests kill daemons, so they run on a cluster of their own (with accounting, as the session
cluster), started once for the module: the session cluster stays healthy for the other tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from contract.seeds import chain_seeds
from contract.slurm_states import END_STATES
from orchestrator.cluster.daemons import daemon_pids
from orchestrator.cluster.queries import node_states
from orchestrator.cluster.record import CONF_NAME
from orchestrator.manifest import MANIFEST_NAME, Manifest
from orchestrator.retry import PATIENCE_ENV
from orchestrator.slurm.commands import QUERY_TIMEOUT_S
from tests.harness.chains import write_sub
from tests.harness.cluster import SESSION_ENV, cluster_cli
from tests.harness.process import BIN as TOOLS
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
        yield Faulty(str(directory), {"SLURM_CONF": str(directory / CONF_NAME)})
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


SLURM_DEFAULT_SLURMD_TIMEOUT_S = 300  # slurm.conf(5)'s SlurmdTimeout when none is set


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
    before = daemon_pids(directory)

    os.kill(before["slurmd-n1"], signal.SIGKILL)
    # Waited on as an event; the bound only tells the cluster's SlurmdTimeout (about 15 s to
    # notice) from SLURM's default (300 s, which would hang the chain for minutes).
    took = wait_for(
        "n1 marked down",
        lambda: node_states(env["SLURM_CONF"]).get("n1", "").startswith("down"),
        timeout=SLURM_DEFAULT_SLURMD_TIMEOUT_S / 2,
    )
    print(f"a dead slurmd noticed in {took:.0f} s")
    # Job 0 lost a node; job 1 needs both nodes, so it waits for n1.
    wait_for("job 0 gone from the queue", lambda: first not in queue(env))
    assert queue(env)[second] == "PENDING"

    again = cluster_cli("up", "--dir", directory)
    assert again.returncode == 0, again.stderr
    assert "restarting slurmd-n1;" in again.stderr
    after = daemon_pids(directory)
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
    before = daemon_pids(directory)
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
    after = daemon_pids(directory)
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
    before = daemon_pids(directory)
    for daemon in ("slurmdbd", "mariadbd"):
        os.kill(before[daemon], signal.SIGKILL)
    wait_for("slurmdbd gone", lambda: daemon_pids(directory)["slurmdbd"] is None)

    again = cluster_cli("up", "--dir", directory)
    assert again.returncode == 0, again.stderr
    assert "restarting mariadbd, slurmdbd;" in again.stderr
    after = daemon_pids(directory)
    assert after["slurmctld"] == before["slurmctld"]

    wait_for("the job in accounting", lambda: accounted(env, job_id) == "COMPLETED", timeout=30)


def test_status_answers_while_accounting_is_down(faulty: Faulty, tmp_path: Path) -> None:
    """slurmdbd stopped under a finished chain: status still reads the jobs (from scontrol, which
    remembers them for MinJobAge) and says once that accounting is unreachable; `cluster up`
    restarts slurmdbd alone and sacct answers again. So for a sweep queued as job arrays, whose
    ended tasks scontrol names by their own numbers."""
    directory, env = faulty.directory, faulty.env
    chain = launch(env, tmp_path, num_jobs=2, nodes=1, hold_s=0)["chain_id"]
    members = run_tool(
        "auto_launch",
        "-n1",
        "--members",
        "2",
        "--run-dir",
        str(tmp_path / "members"),
        str(tmp_path / "hold.sub"),
        env={**env, "HOLD_S": "0"},
    )
    assert members.returncode == 0, members.stderr
    sweep = members.stdout.split()[1].rstrip(":")
    wait_chain(env, chain)
    for member in range(2):
        wait_chain(env, f"{sweep}-{member}")
    _, healthy_s = timed_status(env, chain)
    slurmdbd = daemon_pids(directory)["slurmdbd"]
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
        tasks = [job for chain in status_json(env, sweep)["chains"] for job in chain["jobs"]]
        assert [
            (job["job_id"].partition("_")[2], job["state"], job["source"]) for job in tasks
        ] == [
            ("0", "COMPLETED", "scontrol"),
            ("1", "COMPLETED", "scontrol"),
        ], tasks
    finally:
        again = cluster_cli("up", "--dir", directory)
    assert again.returncode == 0, again.stderr
    assert "restarting slurmdbd;" in again.stderr

    def accounted() -> bool:
        status = status_json(env, chain)
        sources = [job["source"] for job in status["jobs"]]
        return status["accounting_unreachable"] is None and sources == ["sacct", "sacct"]

    wait_for("the chain read from accounting again", accounted, timeout=30)


# ---- the controller down while the chain talks to it (issue 39) ----

# A YAML recipe's job (it runs the chain hook): it waits while the run dir holds it, notes its
# seed, and fails (exit 3) where the run dir says so, once.
OUTAGE_JOB = """\
while [ -e "$ORCH_RUN_DIR/hold" ]; do sleep 0.2; done
echo "$SEED" >> "$ORCH_RUN_DIR/ran"
if [ -e "$ORCH_RUN_DIR/fail_once" ]; then
  rm "$ORCH_RUN_DIR/fail_once"
  touch "$ORCH_RUN_DIR/failing"
  while [ ! -e "$ORCH_RUN_DIR/controller_down" ]; do sleep 0.2; done
  exit 3
fi
"""
OUTAGE_S = 12  # down this long: past the 7.5 s five quick tries waited, well inside the patience


def outage_recipe(tmp_path: Path) -> Path:
    script = tmp_path / "job.sh"
    script.write_text(OUTAGE_JOB)
    recipe = tmp_path / "outage.yaml"
    recipe.write_text(f'template: single\ntime: "00:05:00"\ncommand: [bash, {script}]\n')
    return recipe


def failing_once(env: dict[str, str], tmp_path: Path, run_dir: Path, *args: str) -> dict:
    """A 1-job chain of the outage recipe whose job fails once (exit 3, listed for a retry),
    replaced under --retries 1 rather than restarted in place; auto_launch's summary."""
    run_dir.mkdir()
    (run_dir / "fail_once").touch()
    launched = run_tool(
        "auto_launch", "--json", "-n1", "--retries", "1", "--retry-on-exit", "3",
        "--restarts-in-job", "0", *args, "--run-dir", str(run_dir), str(outage_recipe(tmp_path)),
        env=env,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    return json.loads(launched.stdout.strip().splitlines()[-1])


def sbatch_that_waits(tmp_path: Path, call: int) -> tuple[dict[str, str], Path, Path]:
    """A wrapper around the real sbatch (first on PATH in the returned environment) whose call
    number ``call`` (0-based) touches ``asked`` and waits for ``down`` before it goes on, so
    that the test can stop the controller between two submissions of one auto_launch."""
    fake_bin, asked, down = tmp_path / "bin", tmp_path / "asked", tmp_path / "down"
    fake_bin.mkdir()
    real = shutil.which("sbatch")
    counter = tmp_path / "count"
    (fake_bin / "sbatch").write_text(
        "#!/bin/bash\n"
        f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n+1)) > {counter}\n"
        f'if [ "$n" = {call} ]; then touch {asked}; '
        f"while [ ! -e {down} ]; do sleep 0.1; done; fi\n"
        f'exec {real} "$@"\n'
    )
    (fake_bin / "sbatch").chmod(0o755)
    return {"PATH": f"{fake_bin}:{os.environ['PATH']}"}, asked, down


def stop_controller(faulty: Faulty, job_id: str) -> None:
    """SIGKILL slurmctld once it has saved the queue (as it would have within seconds)."""
    save_controller_state(faulty.env, faulty.directory, job_id)
    os.kill(daemon_pids(faulty.directory)["slurmctld"], signal.SIGKILL)


def restart_controller_after(faulty: Faulty, seconds: float) -> threading.Thread:
    def restart() -> None:
        time.sleep(seconds)
        again = cluster_cli("up", "--dir", faulty.directory)
        assert again.returncode == 0, again.stderr

    thread = threading.Thread(target=restart)
    thread.start()
    return thread


def assert_accounted(env: dict[str, str], name: str, ids: list[str]) -> None:
    """Accounting holds exactly the jobs ``ids`` under this job name, ended ones included (sacct:
    none forgotten, none doubled). Waited for: slurmctld sends its records to slurmdbd on its
    own time, later still after a restart."""

    def listed() -> list[str]:
        out = slurm(env, "sacct", "-X", "-n", "-P", f"--name={name}", "--format=JobID")
        return out.split()

    wait_for(f"accounting to list {ids}", lambda: set(ids) <= set(listed()))
    assert sorted(listed()) == sorted(ids)


def test_a_controller_down_while_auto_launch_submits_leaves_the_chain_whole(
    faulty: Faulty, tmp_path: Path
) -> None:
    """slurmctld dies after auto_launch -n8 has queued two jobs and comes back OUTAGE_S later:
    sbatch is retried, one line per retry, and the chain is its 8 jobs, in order, each with
    its planned seed and dependency, none lost or doubled, each run once.

    Job 0 is held running through the outage: a job that starts between the controller's last
    save and its death is one the restarted controller does not know it started (SLURM's
    limit, not the chain's), which a loaded machine made happen."""
    recipe = outage_recipe(tmp_path)
    wrapper, asked, down = sbatch_that_waits(tmp_path, 2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "hold").touch()
    command = [str(TOOLS / "auto_launch"), "--json", "-n8", "--seed", "7"]
    command += ["--run-dir", str(run_dir), "--name", "outage_submit", str(recipe)]
    launched = subprocess.Popen(
        command,
        env={**os.environ, **faulty.env, **wrapper},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for("the third submission", asked.exists)
    first = queued_ids(run_dir)[0]
    wait_for("job 0 running", lambda: queue(faulty.env).get(first) == "RUNNING")
    stop_controller(faulty, queued_ids(run_dir)[-1])
    down.touch()
    restarting = restart_controller_after(faulty, OUTAGE_S)
    out, err = launched.communicate(timeout=300)
    restarting.join()
    (run_dir / "hold").unlink()
    assert launched.returncode == 0, err
    retries = [line for line in err.splitlines() if "trying again in" in line]
    assert retries and all("Unable to contact slurm controller" in line for line in retries), err
    assert len(retries) < 12, err  # backoff, not a busy loop
    manifest = json.loads((run_dir / "manifest.json").read_text())
    jobs = manifest["jobs"]
    assert [job["index"] for job in jobs] == list(range(8))
    assert [job["seed"] for job in jobs] == chain_seeds(8, 7)
    ids = [job["job_id"] for job in jobs]
    assert [job["dependency"] for job in jobs[1:]] == [f"afterany:{i}" for i in ids[:-1]]
    final = wait_chain(faulty.env, manifest["chain_id"], timeout=240)
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 8
    assert_accounted(faulty.env, "outage_submit", ids)
    assert (run_dir / "ran").read_text().split() == [str(seed) for seed in chain_seeds(8, 7)]
    assert json.loads(out.strip().splitlines()[-1])["chain_id"] == manifest["chain_id"]


def queued_ids(run_dir: Path) -> list[str]:
    """The ids of the jobs auto_launch has queued so far (the manifest and its journal)."""
    return Manifest.load(run_dir / MANIFEST_NAME).job_ids()


def test_a_controller_down_while_a_jobs_end_hook_replaces_it(
    faulty: Faulty, tmp_path: Path
) -> None:
    """Job 0 fails (exit 3, listed with --retry-on-exit) while slurmctld is down: its end hook's
    sbatch of the replacement waits the outage out (one line per retry), and the chain ends
    with exactly its two jobs."""
    run_dir = tmp_path / "run"
    summary = failing_once(faulty.env, tmp_path, run_dir, "--name", "outage_hook")
    job0 = summary["jobs"][0]["job_id"]
    wait_for("job 0 to start failing", (run_dir / "failing").exists, timeout=120)
    stop_controller(faulty, job0)
    (run_dir / "controller_down").touch()
    # Back only once the hook's sbatch has met the outage (a loaded machine may take longer
    # than any fixed outage to get the hook that far).
    log = next((run_dir / "logs").glob("*.out"))
    wait_for("the hook's sbatch to retry", lambda: "trying again in" in log.read_text())
    restart_controller_after(faulty, 0).join()
    final = wait_chain(faulty.env, summary["chain_id"], timeout=240)
    jobs = json.loads((run_dir / "manifest.json").read_text())["jobs"]
    assert [(job["outcome"], job["replaces"]) for job in jobs] == [
        ("failed", None),
        ("completed", 0),
    ]
    assert [job["state"] for job in final["jobs"]] == ["FAILED", "COMPLETED"], final
    assert_accounted(faulty.env, "outage_hook", [job["job_id"] for job in jobs])
    log = run_tool("orchestrator", "logs", summary["chain_id"], "--job", "0", env=faulty.env)
    retries = [line for line in log.stdout.splitlines() if "trying again in" in line]
    assert retries and "Unable to contact slurm controller" in retries[0], log.stdout
    assert "queued job 1" in log.stdout


def test_a_controller_down_past_the_patience_rolls_the_chain_back_and_its_jobs_stay_idle(
    faulty: Faulty, tmp_path: Path
) -> None:
    """With ORCH_SCHEDULER_PATIENCE_S=5 the controller stays down past it: auto_launch fails
    with one error saying what became of the two jobs it had queued (their cancel failed too),
    and exits 1; once the controller is back those jobs start and do not train; the same
    auto_launch again queues the whole chain."""
    recipe = outage_recipe(tmp_path)
    wrapper, asked, down = sbatch_that_waits(tmp_path, 2)
    run_dir = tmp_path / "run"
    command = [str(TOOLS / "auto_launch"), "-n4", "--seed", "3", "--run-dir", str(run_dir)]
    command += ["--name", "outage_bound", str(recipe)]
    env = {**os.environ, **faulty.env, **wrapper, PATIENCE_ENV: "5"}
    launched = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for("the third submission", asked.exists)
    queued = queued_ids(run_dir)
    stop_controller(faulty, queued[-1])
    down.touch()
    _, err = launched.communicate(timeout=120)
    assert launched.returncode == 1, err
    [error] = [line for line in err.splitlines() if line.startswith("error:")]
    assert err.strip().splitlines()[-1] == error, err  # one error, the last word
    assert error.startswith("error: submitting job 3 of 4 failed: sbatch failed:"), error
    assert "Unable to contact slurm controller" in error
    assert "still failing after" in error and PATIENCE_ENV in error
    assert f"cancelling its 2 queued job(s) ({' '.join(queued)}) failed too" in error
    assert "they will not train" in error and "Run the same auto_launch again" in error
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "rolled_back"

    restart_controller_after(faulty, 0).join()
    wait_for("the rolled-back jobs to end", lambda: not set(queued) & set(queue(faulty.env)))
    assert not (run_dir / "ran").exists()  # neither trained
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.out"))
    assert logs.count("this job, which its cancel did not reach, does not train") == 2, logs
    again = run_tool("auto_launch", *command[1:], env={**faulty.env, PATIENCE_ENV: "5"})
    assert again.returncode == 0, again.stderr
    final = wait_chain(faulty.env, json.loads((run_dir / "manifest.json").read_text())["chain_id"])
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 4
    assert (run_dir / "ran").read_text().split() == [str(seed) for seed in chain_seeds(4, 3)]


def test_a_replacement_the_controller_refused_past_the_patience_is_queued_by_the_next_hook(
    faulty: Faulty, tmp_path: Path
) -> None:
    """Job 0 fails while slurmctld is down, and its end hook gives up on the replacement's
    sbatch after a 3-s patience, saying so; once the controller is back, the chain hook's next
    run (`check`, as no later job exists to start) queues it, and the chain finishes."""
    run_dir = tmp_path / "run"
    # sbatch --export=ALL: the job's hook has the patience too
    summary = failing_once({**faulty.env, PATIENCE_ENV: "3"}, tmp_path, run_dir)
    job0 = summary["jobs"][0]["job_id"]
    wait_for("job 0 to start failing", (run_dir / "failing").exists, timeout=120)
    stop_controller(faulty, job0)
    (run_dir / "controller_down").touch()
    log = next((run_dir / "logs").glob("*.out"))
    wait_for("the hook to give up", lambda: "could not queue the replacement" in log.read_text())
    restart_controller_after(faulty, 0).join()
    [job] = Manifest.load(run_dir / MANIFEST_NAME).jobs
    assert job.outcome == "failed" and "listed in --retry-on-exit" in (job.replacement_due or "")
    wait_for("job 0 to end", lambda: job0 not in queue(faulty.env))
    checked = subprocess.run(
        [sys.executable, "-m", "orchestrator.chain_hooks", "check", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **faulty.env},
    )
    assert "queued job 1" in checked.stdout, checked.stdout + checked.stderr
    final = wait_chain(faulty.env, summary["chain_id"], timeout=240)
    assert [job["state"] for job in final["jobs"]] == ["FAILED", "COMPLETED"], final
    jobs = Manifest.load(run_dir / MANIFEST_NAME).jobs
    assert [(j.outcome, j.replaces, j.replacement_due) for j in jobs] == [
        ("failed", None, None),
        ("completed", 0, None),
    ]
