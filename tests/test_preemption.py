"""Preemption on a loopback cluster with a preemptible partition (``cluster up --preemption``):
a job of the urgent partition takes the node of a chain's running training job. The job was
submitted requeueable (the recipe's ``requeue: true``): SLURM sends SIGTERM, the trainer saves,
SLURM requeues the job under the same id, and it resumes from that checkpoint. Recipes without
``requeue`` are refused for the single template, and render ``--no-requeue``."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator.cluster.config import URGENT_PARTITION
from orchestrator.cluster.record import CONF_NAME
from orchestrator.errors import UsageError
from orchestrator.recipe import load_recipe
from tests.harness.chains import launch_json, wait_chain
from tests.harness.cluster import cluster_cli
from tests.harness.process import BIN, REPO, run_tool
from tests.harness.training import metrics, wait_for_step
from tests.harness.wandb_runs import WANDB_OFFLINE

INTERVAL = 4  # checkpoint interval
MAX_STEPS = 48  # enough that neither chain finishes before the preemption reaches it, under load:
# 24 were not, once: one chain's job had trained all 24 when the urgent job came, the other's 4
RECIPE = REPO / "recipes" / "train_tiny_fsdp2.yaml"


@pytest.fixture(scope="module")
def preemptible(tmp_path_factory: pytest.TempPathFactory, slurm_cluster) -> Iterator[Path]:
    """A two-node cluster (2 CPUs each) with the urgent partition, beside the session's (whose
    fixture marks the daemons as this session's, for a killed session's clean-up): its conf."""
    directory = tmp_path_factory.mktemp("preempt")
    started = cluster_cli(
        "up", "--nodes", "2", "--cpus-per-node", "2", "--preemption", "--dir", str(directory)
    )
    assert started.returncode == 0, f"{started.stderr}{started.stdout}"
    yield directory / CONF_NAME
    stopped = cluster_cli("down", "--dir", str(directory))
    assert stopped.returncode == 0, stopped.stderr


def test_a_requeueable_recipe_needs_its_training_in_a_job_step(tmp_path):
    recipe = tmp_path / "single.yaml"
    recipe.write_text("requeue: true\ncommand: [python, -m, train]\n")
    with pytest.raises(UsageError, match="requeue: needs the training in a job step"):
        load_recipe(recipe)


def launch_training(run_dir: Path, recipe: Path, corpus: Path, *options: str) -> dict:
    return launch_json(
        *options,
        "--run-dir",
        str(run_dir),
        str(recipe),
        "--",
        f"data.corpus={corpus}",
        "data.max_duration=8",
        WANDB_OFFLINE,
        f"train.max_steps={MAX_STEPS}",
        f"checkpoint.interval={INTERVAL}",
        cwd=REPO,
    )


def saved_on_sigterm(log: str, how: str) -> int:
    """The step the preempted run saved on SIGTERM, as the chain hook told it."""
    found = re.search(rf"{how}.*training stopped on SIGTERM after saving step (\d+)", log)
    assert found, log[-3000:]
    return int(found[1])


def resumed_from(run_dir: Path, step: int) -> str:
    return f"resumed from {run_dir / 'checkpoints' / f'step_{step}'} at step {step}"


def steps_trained(run_dir: Path) -> list[int]:
    return [row["step"] for row in metrics(run_dir) if "loss" in row]


@pytest.mark.slurm
def test_a_preempted_job_is_requeued_or_replaced(preemptible, tmp_path, corpus, monkeypatch):
    """Two chains of the tiny FSDP2 training, one per node; an urgent job takes both nodes.
    The requeueable chain's job saves on SIGTERM, is requeued under the same id (its next job
    still waiting), resumes from that save and finishes, one W&B run, `logs --follow` following
    it through. The other chain's job (`--no-requeue`) saves too and ends: a failure a new job
    can fix, so --retries queues a replacement, which resumes from that save."""
    monkeypatch.setenv("SLURM_CONF", str(preemptible))
    requeueing = tmp_path / "train_requeue.yaml"
    requeueing.write_text(RECIPE.read_text() + "requeue: true\n")
    kept, replaced = tmp_path / "kept", tmp_path / "replaced"
    # Launched side by side, so that neither has trained far when the other starts.
    with ThreadPoolExecutor(2) as launches:
        first_launch = launches.submit(launch_training, kept, requeueing, corpus, "-n2")
        second_launch = launches.submit(
            launch_training, replaced, RECIPE, corpus, "-n1", "--retries", "1"
        )
        first, second = first_launch.result(), second_launch.result()
    chain, job0 = first["chain_id"], first["jobs"][0]["job_id"]
    follower = subprocess.Popen(
        [str(BIN / "orchestrator"), "logs", chain, "--job", "0", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_step(kept, 1)
    wait_for_step(replaced, 1)
    submitted = time.monotonic()
    urgent = ["sbatch", "-p", URGENT_PARTITION, "-N2", "-c", "2", "-o", "/dev/null"]
    subprocess.run([*urgent, "--wrap", "true"], check=True, capture_output=True)
    log = next((kept / "logs").glob(f"*-{job0}.out"))
    while "was requeued (restart 1)" not in log.read_text():
        assert "max_steps reached" not in log.read_text(), "trained to the end before preempted"
        assert time.monotonic() - submitted < 180, log.read_text()[-3000:]
        time.sleep(0.5)
    back_in = time.monotonic() - submitted
    final = wait_chain(chain, timeout=300)
    followed, _ = follower.communicate(timeout=60)
    other = wait_chain(second["chain_id"], timeout=300)

    text = log.read_text()
    saved = saved_on_sigterm(text, "was preempted: ")
    assert resumed_from(kept, saved) in text
    # Nothing trained after the save is lost: the requeued run goes on from the saved step.
    steps = steps_trained(kept)
    assert steps == sorted(set(steps)) and steps[-1] == MAX_STEPS, steps
    wandb_ids = {path.name.rsplit("-", 1)[1] for path in (kept / "wandb").glob("offline-run-*")}
    assert len(wandb_ids) == 1, wandb_ids
    manifest = json.loads((kept / "manifest.json").read_text())
    assert manifest["status"] == "complete", manifest
    assert [(job["outcome"], job["restarts"]) for job in manifest["jobs"]] == [
        ("finished", 1),
        ("not_started", 0),
    ]
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED", "CANCELLED"], final
    status = run_tool("orchestrator", "status", chain).stdout
    assert "preempted and requeued 1x" in status, status
    assert followed.count("[orch] job ") == 2 and f"finished at step {MAX_STEPS}" in followed

    manifest = json.loads((replaced / "manifest.json").read_text())
    jobs = manifest["jobs"]
    assert [(job["outcome"], job["replaces"], job["restarts"]) for job in jobs] == [
        ("failed", None, 0),
        ("finished", 0, 0),
    ], manifest
    saved = saved_on_sigterm(jobs[1]["reason"], "preempted ")
    logs = run_tool("orchestrator", "logs", second["chain_id"], "--job", "1").stdout
    assert resumed_from(replaced, saved) in logs, logs[-3000:]
    # torchrun answers SIGTERM with exit 1: SLURM says FAILED, the hook knows better.
    assert [job["state"] for job in other["jobs"]] == ["FAILED", "COMPLETED"], other
    print(f"preempted at step {saved}: running again {back_in:.0f} s after the urgent job came")
