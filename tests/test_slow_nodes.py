"""A slow node left out of a chain's next jobs (orchestrator/slow_nodes.py, applied by the chain
hook): the decisions on numbers, the settings' bad values, then chains on a 3-node loopback
cluster whose one node is slow (every rank SLURM runs there throttled from outside): the trainer
names the rank on it, and either the hook keeps the next job off it, or, where the job holds a
spare node, the training moves off it within the job; either way it then trains faster."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.run_dir import avoid_nodes_path
from orchestrator.cluster.record import CONF_NAME
from orchestrator.errors import UsageError
from orchestrator.manifest import MANIFEST_NAME, Manifest
from orchestrator.recipe import load_recipe
from orchestrator.slow_nodes import (
    NodeDecision,
    decide,
    exclude_option,
    exclusions_for,
    usable_nodes,
)
from orchestrator.slurm.partitions import Partition, check_partition
from orchestrator.slurm.resources import JobResources
from tests.harness.chains import tiny_training_chain, wait_chain_quietly
from tests.harness.cluster import cluster_cli
from tests.harness.process import REPO, run_tool
from tests.harness.training import metrics_or_empty, ranks_of, slow_node, wait_until

EVERY = 10  # steps per straggler interval (production's default: 20)
# From the first throttled step to the blame: up to 4 intervals (the one under way, then 3
# whole ones) of ~0.5-s throttled steps alone (named in 5-6 s). Under the full suite the other
# worker's load blurs the 2x throttle to ~1.5x, at the judge's threshold, and three intervals in
# a row above it came after ~90 s once (step 370 of a clean run of 9900d61): room for that.
NAMED_WITHIN_S = 240
# The slow node's ranks stopped 0.1 s of every 0.15 s (~3x slower alone): under the full
# suite's load a 2x throttle blurred to ~1.1-1.5x, too close to the judge's 1.5x and the
# assertions' 1.1x to tell apart from the other worker's noise.
THROTTLE_STOPPED_S = 0.1
FAST_STEPS = 2 * EVERY  # steps the next job trains before it is stopped
TWO_NODES = "recipes/train_tiny_2node.yaml"
RUN = (
    "wandb.mode=disabled",
    "train.max_steps=1000",
    "train.log_every=1",
    f"train.straggler.every={EVERY}",
    "checkpoint.interval=1000",
    "optim.warmup_steps=2",
)


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


def test_spare_nodes_are_allocated_and_only_a_distributed_recipe_has_them(tmp_path):
    """The allocation holds the spares (a partition too small for them refuses the job); a
    single-process recipe has no step to run on part of its nodes."""
    single = tmp_path / "single.yaml"
    single.write_text("spare_nodes: 1\ncommand: [python, -m, train]\n")
    with pytest.raises(UsageError, match="spare_nodes: only template distributed"):
        load_recipe(single)
    resources = JobResources(nodes=2, spare_nodes=1)
    assert resources.allocated == 3
    partition = Partition("debug", True, "up", 2, 4, 0, None)
    with pytest.raises(UsageError, match="3 nodes asked; partition 'debug' has 2"):
        check_partition(resources, [partition])


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


def job_rows(run_dir: Path, index: int, launch: int | None = None) -> list[dict]:
    """Job ``index``'s step rows (of its ``launch``-th in-job restart only, where given)."""
    return [
        row
        for row in metrics_or_empty(run_dir)
        if row.get("job_index") == index
        and "step_time_s" in row
        and (launch is None or row.get("in_job_restart", 0) == launch)
    ]


def step_ratio(slow: list[dict], fast: list[dict], blamed: int) -> float:
    """Median step time on the slow node (its last intervals up to the blame) over the fast
    one's (past its first steps)."""
    throttled = [row["step_time_s"] for row in slow if blamed - EVERY < row["step"] <= blamed]
    return statistics.median(throttled) / statistics.median(r["step_time_s"] for r in fast[3:])


def blamed_step(run_dir: Path) -> int:
    return next(row["step"] for row in metrics_or_empty(run_dir) if "straggler_rank" in row)


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
    summary = tiny_training_chain(
        run_dir, corpus, 2, 0, *RUN, launch_args=("--exclude-slow-nodes", "1"), recipe=TWO_NODES
    )
    first, second = (job["job_id"] for job in summary["jobs"])
    wait_until(lambda: job_rows(run_dir, 0), 240, "job 0's first step")
    slow = job_nodes(first)[1]
    log = run_dir / "logs" / f"train_tiny_2node-{first}.out"
    with slow_node(slow, run_dir, stopped_s=THROTTLE_STOPPED_S):
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
    ratio = step_ratio(job_rows(run_dir, 0), job_rows(run_dir, 1), blamed_step(run_dir))
    print(f"named after {named_s:.1f} s; step time slow-node job / next job: {ratio:.2f}x")
    assert ratio > 1.1


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_with_a_spare_node_moves_off_a_slow_one_in_place(
    three_nodes, tmp_path, corpus, monkeypatch
):
    """A recipe with ``spare_nodes: 1`` holds all 3 nodes and trains on 2; one of those is
    slow: the trainer names its rank, saves and stops; the hook launches the training again in
    the same job off that node (the spare takes its place), and the relaunch trains faster."""
    monkeypatch.setenv("SLURM_CONF", str(three_nodes))
    recipe = tmp_path / "train_tiny_spare.yaml"
    recipe.write_text((REPO / TWO_NODES).read_text() + "spare_nodes: 1\n")
    run_dir = tmp_path / "run"
    summary = tiny_training_chain(run_dir, corpus, 1, 0, *RUN, recipe=str(recipe))
    (job_id,) = (job["job_id"] for job in summary["jobs"])
    wait_until(lambda: job_rows(run_dir, 0), 240, "the first step")
    assert len(job_nodes(job_id)) == 3
    first_nodes = set(ranks_of(run_dir).values())
    slow = sorted(first_nodes)[-1]
    log = run_dir / "logs" / f"train_tiny_spare-{job_id}.out"
    with slow_node(slow, run_dir, stopped_s=THROTTLE_STOPPED_S):
        wait_until(lambda: "restarting the training in place" in log.read_text(), 180, "swap")
        wait_until(lambda: len(job_rows(run_dir, 0, launch=1)) >= FAST_STEPS, 240, "relaunch")
        moved_to = set(ranks_of(run_dir).values())
        stop_job(job_id)
        final = wait_chain_quietly(run_dir, summary["chain_id"], timeout=180)
    assert len(first_nodes) == 2 and slow not in moved_to and len(moved_to) == 2, moved_to
    assert final["jobs"][0]["state"] == "COMPLETED", final
    text = log.read_text()
    assert f"stopped to leave slow node {slow}: restarting the training in place (1 of 2)" in text
    assert f"[orch] the step stays off {slow}" in text
    assert avoid_nodes_path(run_dir, job_id).read_text() == f"{slow}\n"
    manifest = Manifest.load(run_dir / MANIFEST_NAME)
    assert manifest.jobs[0].in_job_restarts == 1 and manifest.slow_nodes[0].node == slow
    blamed = blamed_step(run_dir)
    ratio = step_ratio(job_rows(run_dir, 0, 0), job_rows(run_dir, 0, 1), blamed)
    named = next(row for row in job_rows(run_dir, 0, 0) if row["step"] == blamed)
    moved_s = job_rows(run_dir, 0, 1)[0]["time"] - named["time"]
    print(
        f"from the blame to the first step off the node: {moved_s:.1f} s; step time on the "
        f"slow node / after the move in place: {ratio:.2f}x"
    )
    assert ratio > 1.1
