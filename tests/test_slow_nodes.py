"""A slow node left out of a chain's next jobs (orchestrator/slow_nodes.py, applied by the chain
hook): the decisions on numbers, the settings' bad values, then a chain on a 3-node loopback
cluster whose one node is slow (every rank SLURM runs there throttled from outside): its trainer
names the rank on it, the hook keeps the next job off it, and that job trains faster."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cluster.record import CONF_NAME
from orchestrator.manifest import MANIFEST_NAME, Manifest
from orchestrator.slow_nodes import (
    NodeDecision,
    decide,
    exclude_option,
    exclusions_for,
    usable_nodes,
)
from tests.harness.chains import launch_json, wait_chain_quietly
from tests.harness.cluster import cluster_cli
from tests.harness.process import REPO, run_tool
from tests.harness.training import metrics_or_empty, slow_node, wait_until

EVERY = 10  # steps per straggler interval (production's default: 20)
# From the first throttled step to the blame: up to 4 intervals (the one under way, then 3
# whole ones) of ~0.5-s throttled steps, with room for a machine loaded by other tests.
NAMED_WITHIN_S = 90
FAST_STEPS = 2 * EVERY  # steps the next job trains before it is stopped


def deciding(node: str, decided: list[NodeDecision], **given) -> NodeDecision:
    settings = {
        "why": "rank 1",
        "job": 0,
        "decided": decided,
        "cap": 2,
        "readmit_after": 0,
        "usable": {"n1", "n2", "n3"},
        "needed": 2,
        "partition": "debug",
        **given,
    }
    return decide(node, **settings)


def test_a_named_node_is_left_out_while_the_partition_has_room_and_the_cap_allows():
    first = deciding("n2", [])
    assert first.excluded and first.readmit_at is None
    assert exclusions_for([first], 0) == [] and exclusions_for([first], 5) == ["n2"]
    assert "excluded from job 1 on (rank 1)" in first.line()
    # n1 out too would leave the partition 1 usable node for 2-node jobs.
    second = deciding("n1", [first])
    assert not second.excluded and "would keep 1 usable node(s)" in second.kept
    assert exclusions_for([first, second], 3) == ["n2"]
    capped = deciding("n1", [first], cap=1, usable={"n1", "n2", "n3", "n4"})
    assert capped.kept == "1 node(s) already out, the chain's cap (--exclude-slow-nodes 1)"
    off = deciding("n2", [], cap=0)
    assert "--exclude-slow-nodes 0" in off.kept and exclusions_for([off], 4) == []


def test_a_node_is_taken_back_after_the_jobs_the_setting_gives():
    named = deciding("n2", [], job=3, readmit_after=2)
    assert named.readmit_at == 6 and "until job 6" in named.line()
    assert [exclusions_for([named], index) for index in (3, 4, 5, 6)] == [[], ["n2"], ["n2"], []]
    # Once back (job 6 on), it counts against the cap no more: a node job 4 names stays in,
    # one job 5 names goes out.
    assert deciding("n1", [named], job=4, cap=1, usable={"n1", "n2", "n3", "n4"}).kept
    assert deciding("n1", [named], job=5, cap=1, usable={"n1", "n2", "n3", "n4"}).excluded


def test_usable_nodes_and_the_exclude_value():
    states = {"n1": "idle", "n2": "alloc", "n3": "down*", "n4": "drain", "n5": "mix~", "n6": "comp"}
    assert usable_nodes(states) == {"n1", "n2", "n6"}
    assert exclude_option("gpu[01-02]", ["n2", "n5"]) == "gpu[01-02],n2,n5"
    assert exclude_option("", ["n2"]) == "n2"


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--exclude-slow-nodes", "-1", "--exclude-slow-nodes -1: give 0 (never exclude a node)"),
        ("--readmit-slow-nodes", "-2", "--readmit-slow-nodes -2: give 0 (never take a slow"),
    ],
)
def test_bad_slow_node_settings_are_one_line_and_exit_2(flag, value, message, tmp_path):
    refused = run_tool(
        "auto_launch", flag, value, "--run-dir", str(tmp_path / "run"), "recipes/smoke.sub"
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.count("error:") == 1 and message in refused.stderr, refused.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory: pytest.TempPathFactory, slurm_cluster) -> Iterator[Path]:
    """A 3-node cluster (2 CPUs each: a 2-node job and a spare) beside the session's (whose
    fixture marks the daemons as this session's, for a killed session's clean-up): its conf."""
    directory = tmp_path_factory.mktemp("spare")
    started = cluster_cli("up", "--nodes", "3", "--cpus-per-node", "2", "--dir", str(directory))
    assert started.returncode == 0, f"{started.stderr}{started.stdout}"
    yield directory / CONF_NAME
    stopped = cluster_cli("down", "--dir", str(directory))
    assert stopped.returncode == 0, stopped.stderr


def job_nodes(job_id: str) -> list[str]:
    """The nodes SLURM gave a running job, one name each."""
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True
    ).stdout
    listed = next(word for word in shown.split() if word.startswith("NodeList="))
    names = subprocess.run(
        ["scontrol", "show", "hostnames", listed.partition("=")[2]],
        capture_output=True,
        text=True,
        check=True,
    )
    return names.stdout.split()


def job_rows(run_dir: Path, index: int) -> list[dict]:
    return [
        row
        for row in metrics_or_empty(run_dir)
        if row.get("job_index") == index and "step_time_s" in row
    ]


def stop_job(job_id: str) -> None:
    """What SLURM does before a job's time limit: USR1 to the batch shell (it saves, stops)."""
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)


@pytest.mark.slurm
@pytest.mark.slow
def test_the_chain_leaves_a_slow_node_out_of_its_next_job(
    three_nodes, tmp_path, corpus, monkeypatch
):
    """2 jobs of 2-node training on 3 nodes, one of which is slow from the start: job 0's
    trainer names the rank there, its end hook keeps job 1 off the node (n+1 nodes: room
    for it), job 1 runs on the other two and trains faster; status lists the node."""
    monkeypatch.setenv("SLURM_CONF", str(three_nodes))
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n2",
        "--exclude-slow-nodes",
        "1",
        "--run-dir",
        str(run_dir),
        "recipes/train_tiny_2node.yaml",
        "--",
        f"data.corpus={corpus}",
        "data.max_duration=8",
        "wandb.mode=disabled",
        "train.max_steps=1000",
        "train.log_every=1",
        f"train.straggler.every={EVERY}",
        "checkpoint.interval=1000",
        "optim.warmup_steps=2",
        cwd=REPO,
    )
    first, second = (job["job_id"] for job in summary["jobs"])
    wait_until(lambda: job_rows(run_dir, 0), 240, "job 0's first step")
    slow = job_nodes(first)[1]
    log = run_dir / "logs" / f"train_tiny_2node-{first}.out"
    with slow_node(slow, run_dir):
        began = time.monotonic()
        wait_until(lambda: f"slow: node {slow}, rank" in log.read_text(), NAMED_WITHIN_S, "blame")
        named_s = time.monotonic() - began
        stop_job(first)
        wait_until(lambda: len(job_rows(run_dir, 1)) >= FAST_STEPS, 240, "job 1's steps")
        assert slow not in job_nodes(second)
        stop_job(second)
        final = wait_chain_quietly(run_dir, summary["chain_id"], timeout=180)
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED", "COMPLETED"], final
    manifest = Manifest.load(run_dir / MANIFEST_NAME)
    (decision,) = manifest.slow_nodes
    assert decision.node == slow and decision.excluded and decision.job == 0, decision
    assert manifest.jobs[1].avoids == [slow] and manifest.jobs[0].slow[0]["node"] == slow
    shown = run_tool("orchestrator", "status", summary["chain_id"])
    assert f"slow node {slow} excluded from job 1 on (rank" in shown.stdout, shown.stdout
    blamed = next(row["step"] for row in metrics_or_empty(run_dir) if "straggler_rank" in row)
    throttled = [row["step_time_s"] for row in job_rows(run_dir, 0) if row["step"] > blamed - EVERY]
    fast = [row["step_time_s"] for row in job_rows(run_dir, 1)[3:]]
    ratio = statistics.median(throttled) / statistics.median(fast)
    print(f"named after {named_s:.1f} s; step time slow-node job / next job: {ratio:.2f}x")
    assert ratio > 1.1, (throttled, fast)
