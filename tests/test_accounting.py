"""What `orchestrator status` reports for jobs that left the queue: accounting (sacct) on the
session cluster, which runs slurmdbd; the run dir where neither controller nor accounting
answers; and which names it takes for a sweep."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.cluster.config import free_ports, render_conf
from orchestrator.cluster.daemons import daemon_pids
from orchestrator.cluster.record import CONF_NAME, DBD_CONF_NAME, ClusterInfo
from orchestrator.manifest import JobRecord, Manifest, orch_home, register_chain, register_sweep
from orchestrator.slurm.commands import QUERY_TIMEOUT_S
from tests.harness.chains import launch_json, wait_chain, write_sub
from tests.harness.cluster import LoopbackCluster, calls_of, counted_slurm, wait_gone
from tests.harness.process import run_tool
from tests.harness.results import make_chain, train_row

BODY = """
sleep 1
if [ "$ORCH_JOB_INDEX" = "${FAIL_AT:-none}" ]; then exit 3; fi
"""


@pytest.mark.slurm
def test_the_session_cluster_keeps_its_accounting_to_itself(
    slurm_cluster: LoopbackCluster,
) -> None:
    conf = slurm_cluster.conf.read_text()
    assert "AccountingStorageType=accounting_storage/slurmdbd" in conf
    dbd_conf = slurm_cluster.directory / DBD_CONF_NAME
    mode = dbd_conf.stat()
    assert stat.S_IMODE(mode.st_mode) == 0o600 and mode.st_uid == 0
    assert "Pass" not in dbd_conf.read_text()  # the database trusts root on its own socket
    mariadbd = daemon_pids(slurm_cluster.directory)["mariadbd"]
    argv = Path(f"/proc/{mariadbd}/cmdline").read_bytes().decode().split("\0")
    assert argv[1] == "--no-defaults" and "--skip-networking" in argv
    assert f"--datadir={slurm_cluster.directory / 'db' / 'data'}" in argv
    clusters = subprocess.run(
        ["sacctmgr", "--noheader", "--parsable2", "list", "cluster", "format=cluster"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert clusters.stdout.split() == ["loopback"]


@pytest.mark.slurm
def test_status_reads_jobs_that_left_the_queue_from_sacct(
    empty_queue: LoopbackCluster, tmp_path: Path
) -> None:
    recipe = write_sub(tmp_path / "acct.sub", BODY)
    summary = launch_json(
        "-n2", "--run-dir", str(tmp_path / "run"), str(recipe), env={"FAIL_AT": "1"}
    )
    wait_chain(summary["chain_id"])
    deadline = time.monotonic() + 20
    while True:  # slurmdbd records a job's end a moment after the controller knows it
        status = run_tool("orchestrator", "status", summary["chain_id"], "--json")
        assert status.returncode == 0, status.stderr
        jobs = json.loads(status.stdout)["jobs"]
        if [job["source"] for job in jobs] == ["sacct", "sacct"]:
            break
        assert time.monotonic() < deadline, jobs
        time.sleep(0.5)
    assert [(job["state"], job["exit_code"]) for job in jobs] == [("COMPLETED", 0), ("FAILED", 3)]
    for job in jobs:
        assert re.fullmatch(r"00:00:0[1-9]", job["elapsed"]), job
        assert job["nodes"] in ("n1", "n2"), job
    assert json.loads(status.stdout)["controller_unreachable"] is None


def dead_cluster_conf(directory: Path) -> Path:
    """A slurm.conf whose controller nobody runs, and no accounting: SLURM answers nothing."""
    port = free_ports(1)[0]
    info = ClusterInfo(
        directory=str(directory),
        conf=str(directory / CONF_NAME),
        hostname="localhost",
        nodes=["n1"],
        cpus_per_node=1,
        controller_port=port,
        node_ports={"n1": port},
        started_munged=False,
        munged_pid=None,
    )
    Path(info.conf).write_text(render_conf(info))
    return Path(info.conf)


def slurm_chain(run_dir: Path, job_ids: list[str]) -> Manifest:
    run_dir.mkdir(parents=True)
    manifest = Manifest(
        chain_id=f"acct-{run_dir.name}",
        recipe=str(run_dir / "r.sub"),
        recipe_sha256="0" * 64,
        script=str(run_dir / "r.sub"),
        run_dir=str(run_dir),
        backend="slurm",
        dependency_kind="afterany",
        num_jobs=len(job_ids),
        args=[],
        base_seed=None,
        git_sha=None,
        git_dirty=None,
        created=time.time(),
        status="submitted",
        jobs=[JobRecord(index, 7 + index, job_id) for index, job_id in enumerate(job_ids)],
    )
    manifest.save()
    return manifest


# A job id no controller of the session has given (SLURM's largest is 67,108,863): squeue
# refuses a lone id it does not know ("Invalid job id specified"), as it does once a finished
# job has been purged (MinJobAge past).
FORGOTTEN_JOB_ID = "67108000"


def test_a_chain_whose_lone_job_slurm_forgot_is_read_from_the_run_dir(
    slurm_cluster: LoopbackCluster, tmp_path: Path
) -> None:
    """``status`` and ``list`` answer for a chain whose only job SLURM no longer knows (a
    lone-job chain a week old): the run dir tells its end. squeue's refusal of the lone id
    once made ``orchestrator list`` fail for every chain."""
    manifest = slurm_chain(tmp_path / "run", [FORGOTTEN_JOB_ID])
    register_chain(manifest)
    logs = tmp_path / "run" / "logs"
    logs.mkdir()
    (logs / f"r-{FORGOTTEN_JOB_ID}.out").write_text(
        f"[orch] job {FORGOTTEN_JOB_ID}\n[orch] training exited with status 0\n"
    )
    status = run_tool("orchestrator", "status", manifest.run_dir, "--json")
    assert status.returncode == 0, status.stderr
    [job] = json.loads(status.stdout)["jobs"]
    assert (job["state"], job["source"]) == ("COMPLETED", "run dir"), job
    listed = run_tool("orchestrator", "list")
    assert listed.returncode == 0, listed.stderr
    assert manifest.chain_id in listed.stdout


def test_status_without_controller_or_accounting_reads_the_run_dir(tmp_path: Path) -> None:
    conf = dead_cluster_conf(tmp_path)
    manifest = slurm_chain(tmp_path / "run", ["101", "102", "103"])
    logs = tmp_path / "run" / "logs"
    logs.mkdir()
    (logs / "r-101.out").write_text("[orch] job 101\n[orch] training exited with status 0\n")
    (logs / "r-102.out").write_text("[orch] job 102\n")
    rows = [
        {**train_row(manifest.chain_id, step, 1, 1.0), "slurm_job_id": "102"} for step in (6, 7)
    ]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    env = {"SLURM_CONF": str(conf)}
    # The tool's start-up under the same load, just before: a dead controller may add one
    # query's timeout to it (twice as slow, say), never a retry loop's minutes.
    started = time.monotonic()
    assert run_tool("orchestrator", "status", "--help", env=env).returncode == 0
    start_up = time.monotonic() - started
    started = time.monotonic()
    status = run_tool("orchestrator", "status", manifest.run_dir, "--json", env=env)
    took = time.monotonic() - started
    assert status.returncode == 0, status.stderr
    bound = 2 * start_up + QUERY_TIMEOUT_S
    assert took < bound, f"status took {took:.1f} s with no controller (bound {bound:.1f} s)"
    payload = json.loads(status.stdout)
    assert "DOWN" in payload["controller_unreachable"]
    jobs = payload["jobs"]
    assert [(job["state"], job["source"]) for job in jobs] == [
        ("COMPLETED", "run dir"),
        ("STARTED", "run dir"),
        ("NOT_STARTED", "run dir"),
    ]
    assert jobs[0]["exit_code"] == 0
    assert "metrics up to step 7" in jobs[1]["reason"]

    text = run_tool("orchestrator", "status", manifest.run_dir, env=env)
    assert text.returncode == 0, text.stderr
    assert "SLURM controller unreachable" in text.stdout


def test_a_run_dir_with_a_json_file_beside_it_is_no_sweep(tmp_path: Path) -> None:
    run_dir = make_chain(tmp_path, "beside", [train_row("beside", 1, 0, 2.0)])
    Path(f"{run_dir}.json").write_text(json.dumps({"not": "a sweep index"}))
    for name in (str(run_dir), os.path.relpath(run_dir)):
        status = run_tool("orchestrator", "status", name)
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith("chain beside "), status.stdout


def test_a_malformed_sweep_index_is_a_clear_error() -> None:
    index = orch_home() / "sweeps" / "broken-sweep.json"
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(json.dumps({"sweep_id": "broken-sweep"}))
    status = run_tool("orchestrator", "status", "broken-sweep")
    assert status.returncode == 2
    assert f"sweep index {index} has no list of members" in status.stderr
    assert "Traceback" not in status.stderr
    # Listing every chain and sweep leaves it out, says so, and lists the rest.
    listed = run_tool("orchestrator", "list")
    assert listed.returncode == 0, listed.stderr
    assert f"warning: sweep index {index} has no members, created: left out" in listed.stderr
    assert "Traceback" not in listed.stderr


MEMBERS = 4


@pytest.mark.slurm
def test_a_sweep_is_looked_at_in_one_query_of_each_kind(
    empty_queue: LoopbackCluster, tmp_path: Path
) -> None:
    """``status``, ``list`` and ``cancel`` of a sweep of four 2-job chains ask SLURM once per
    look whatever the number of members: one ``scontrol ping``, one squeue, at most one sacct
    and one ``scontrol show job`` (counted by wrappers first on PATH), queued and after every job
    ended; ``cancel`` is one scancel for every member's jobs; and each member's jobs are what
    ``status`` of that chain alone says."""
    recipe = write_sub(tmp_path / "sleep.sub", "sleep 60\n")
    members = []
    for member in range(MEMBERS):
        run_dir = tmp_path / str(member)
        summary = launch_json("-n2", "--run-dir", str(run_dir), str(recipe))
        members.append({"chain_id": summary["chain_id"], "run_dir": str(run_dir), "overrides": []})
    register_sweep("looked-at", members)
    env, calls = counted_slurm(tmp_path / "counted")
    one_look = ["scontrol ping", "squeue", "sacct", "scontrol show"]

    def looked(*command: str) -> subprocess.CompletedProcess[str]:
        done = run_tool("orchestrator", *command, env=env)
        assert done.returncode == 0, done.stderr
        made = calls_of(calls)
        assert made[:2] == one_look[:2] and set(made) <= set(one_look), made
        assert all(made.count(call) == 1 for call in made), made
        return done

    sweep = json.loads(looked("status", "looked-at", "--json").stdout)
    assert [chain["chain_id"] for chain in sweep["chains"]] == [m["chain_id"] for m in members]
    for chain in sweep["chains"]:
        alone = json.loads(run_tool("orchestrator", "status", chain["chain_id"], "--json").stdout)
        assert [job["job_id"] for job in alone["jobs"]] == [job["job_id"] for job in chain["jobs"]]
        assert all(job["state"] in ("PENDING", "RUNNING") for job in chain["jobs"]), chain
    listed = looked("list").stdout
    assert all(member["chain_id"] in listed for member in members)
    cancelled = run_tool("orchestrator", "cancel", "looked-at", env=env)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.count("cancelled 2 job(s)") == MEMBERS, cancelled.stdout
    made = calls_of(calls)
    assert made.count("squeue") == 1 and made.count("scancel") == 1, made
    job_ids = [job["job_id"] for chain in sweep["chains"] for job in chain["jobs"]]
    wait_gone(job_ids)
    ended = json.loads(looked("status", "looked-at", "--json").stdout)
    states = {job["state"] for chain in ended["chains"] for job in chain["jobs"]}
    assert states == {"CANCELLED"}, ended
