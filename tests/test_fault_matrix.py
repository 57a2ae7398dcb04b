"""The fault matrix's training rows on the loopback cluster: a rank killed mid-step, and a job
killed in the middle of writing a checkpoint. Each asserts what every row of docs/faults.md
promises: the chain reaches max_steps with no user action, a job resumes from exactly the newest
complete checkpoint (so at most one checkpoint interval of steps is lost), torn checkpoints are
never loaded and are removed, and the manifest and status say what happened.

A kill lands inside a checkpoint write only by luck (a tiny model's save takes a fraction of a
second), so the tear test holds the write open with the checkpoint writer's test hook
(``PAUSE_ENV``, train/checkpoint/pauses_for_tests.py): rank 0 pauses with every rank's files
written and no marker yet, and announces it, and the test kills the job at exactly that moment.

The other rows live beside the code they exercise: a dead slurmd or slurmctld
(tests/test_cluster_faults.py), a full or read-only disk and non-finite weights
(tests/test_checkpoint.py), a diverging run and a clean scancel (tests/test_self_healing.py),
a hung rank (tests/test_hang.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from contract.run_dir import MARKER, scan_checkpoints
from orchestrator.cluster.config import KILL_WAIT_S
from tests.harness.chains import tiny_training_chain, wait_chain, wait_chain_quietly
from tests.harness.cluster import queue_ids, wait_gone
from tests.harness.process import run_tool
from tests.harness.training import KILLED_RANK_ENDS_JOB_S, metrics, training_rank, wait_until
from train.checkpoint.pauses_for_tests import PAUSE_ENV, PAUSED_SUFFIX

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
PAUSED_AT = re.compile(r"checkpoint write paused at (\S+) for \S+ s: its files ([a-z ]+),")
INTERVAL = 2  # checkpoint.interval of every chain here: a save every other step
TORN_STEP, MAX_STEPS = 4, 6  # the tear test: the save torn, and where its chains end
# An armed pause: far past the loopback cluster's KillWait (orchestrator/cluster/config.py), so
# after scancel's SIGTERM SLURM's SIGKILL comes first and the save cannot be finished.
PAUSE_S = 6 * KILL_WAIT_S


def launch(
    run_dir: Path,
    corpus: Path,
    jobs: int,
    *overrides: str,
    retries: int = 0,
    env: dict[str, str] | None = None,
) -> dict:
    """``auto_launch`` of the tiny FSDP2 recipe (2 ranks) saving every ``INTERVAL`` steps;
    ``env`` reaches the jobs (sbatch exports the submitting environment)."""
    return tiny_training_chain(
        run_dir,
        corpus,
        jobs,
        retries,
        f"checkpoint.interval={INTERVAL}",
        "checkpoint.keep=10",  # every loaded checkpoint is still there to inspect
        "wandb.enabled=false",  # W&B is not what fails here; its start costs seconds a job
        *overrides,
        env=env,
        # the planner is not under test here: its check costs ~6 s of CPU; these rows are the
        # replacement rung, which a job reaches once its in-place restarts are spent (those are
        # tests/test_in_job_restart.py's)
        launch_args=("--no-plan-check", "--restarts-in-job", "0"),
    )


def complete_steps(checkpoints: Path) -> list[int]:
    """The steps of the complete checkpoints on disk: ``step_N`` directories with the marker."""
    return sorted(scan_checkpoints(checkpoints)[0])


def job_log(chain_id: str, index: int) -> str:
    return run_tool("orchestrator", "logs", chain_id, "--job", str(index)).stdout


def resumed_checkpoints(chain_id: str) -> list[tuple[Path, int]]:
    logs = run_tool("orchestrator", "logs", chain_id).stdout
    return [(Path(path), int(step)) for path, step in RESUMED.findall(logs)]


def assert_only_complete_checkpoints_loaded(chain_id: str) -> list[int]:
    loaded = resumed_checkpoints(chain_id)
    for path, step in loaded:
        assert path.name == f"step_{step}" and (path / MARKER).is_file(), path
    return [step for _, step in loaded]


def test_a_rank_killed_mid_step_ends_the_job_in_seconds_and_the_chain_finishes(
    slurm_cluster, tmp_path, corpus
):
    run_dir = tmp_path / "run"
    submitted = time.time()
    summary = launch(run_dir, corpus, 2, "train.max_steps=12", retries=1)
    chain, job_id = summary["chain_id"], summary["jobs"][0]["job_id"]
    wait_until(lambda: any(row["step"] >= 5 for row in metrics_or_none(run_dir)), 300, "step 5")
    victim = training_rank(run_dir)  # one scan of the processes, once the ranks are training
    assert victim is not None, "no rank of job 0 found while it trains"
    first_launch_s = min(row["time"] for row in metrics(run_dir) if "loss" in row) - submitted
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(
        lambda: job_id not in queue_ids(),
        max(KILLED_RANK_ENDS_JOB_S, first_launch_s),
        f"job 0 to end after a rank was SIGKILLed (its start took {first_launch_s:.0f} s)",
    )
    ended_s = time.monotonic() - killed
    print(f"job ended {ended_s:.1f} s after the kill; its start took {first_launch_s:.1f} s")
    newest = max(complete_steps(run_dir / "checkpoints"))

    final = wait_chain_quietly(run_dir, chain, timeout=400)
    states = [job["state"] for job in final["jobs"]]
    assert states[:2] == ["FAILED", "COMPLETED"], final
    assert metrics(run_dir)[-1]["step"] == 12
    assert assert_only_complete_checkpoints_loaded(chain) == [newest]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["jobs"][0]["outcome"] == "failed"
    # The replacement queued for job 0 was cancelled unstarted once job 1 finished training.
    (replacement,) = [job for job in manifest["jobs"] if job.get("replaces") == 0]
    assert replacement["outcome"] == "not_started" and manifest["status"] == "complete"
    # The surviving rank's collective failed: exit 6, a failure a new job can fix.
    assert replacement["reason"].endswith("(exit 6): a rank lost a peer"), replacement
    status = run_tool("orchestrator", "status", chain).stdout
    assert "failed" in status and "replaces job 0" in status, status


@dataclass(frozen=True, eq=False)  # hashed by identity
class TornChain:
    """A chain of two jobs saving every ``INTERVAL`` steps. Job 0 is killed with ``scancel
    *how JOB_ID{target}`` while the checkpoint writer's test hook holds its save of
    ``TORN_STEP`` before the marker (``written``: what the hook says of the files, sync or
    in the background), and ends ``killed_state``; job 1 recovers and trains to ``MAX_STEPS``.

    SLURM takes ``--signal=KILL`` for a whole job as a cancel (SIGTERM, then SIGKILL after
    KillWait); sent to the job's step (``target=".0"``) it kills the training at once."""

    root: Path
    summary: dict
    how: tuple[str, ...]
    target: str
    killed_state: str
    written: str

    @classmethod
    def launch(
        cls,
        root: Path,
        corpus: Path,
        *overrides: str,
        how: tuple[str, ...] = (),
        target: str = "",
        killed_state: str = "CANCELLED",
    ) -> TornChain:
        """Arm the pause (a file in ``root/pauses``) and launch the chain in ``root/run``."""
        pauses = root / "pauses"
        pauses.mkdir(parents=True)
        (pauses / f"step_{TORN_STEP}").write_text(f"{PAUSE_S}\n")
        summary = launch(
            root / "run",
            corpus,
            2,
            f"train.max_steps={MAX_STEPS}",
            *overrides,
            env={PAUSE_ENV: str(pauses)},
        )
        async_save = "checkpoint.async_save=true" in overrides
        written = "written in the background" if async_save else "written"
        return cls(root, summary, how, target, killed_state, written)

    @property
    def id(self) -> str:
        return self.summary["chain_id"]

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def announcement(self) -> Path:
        """Where the hook says that the save is paused (the armed file, renamed)."""
        return self.root / "pauses" / f"step_{TORN_STEP}{PAUSED_SUFFIX}"

    def tear(self) -> Path:
        """Kill job 0 in its paused save; the save's temporary directory, checked torn."""
        announcement = self.announcement.read_text()
        tmp, written = PAUSED_AT.search(announcement).groups()
        job_id = self.summary["jobs"][0]["job_id"]
        subprocess.run(["scancel", *self.how, f"{job_id}{self.target}"], check=True)
        # SLURM's SIGKILL comes KillWait after the SIGTERM: the paused save outlives it.
        wait_until(
            lambda: job_id not in queue_ids(), KILL_WAIT_S + 30, f"job 0 of {self.id} to end"
        )
        torn = Path(tmp)
        assert written == self.written, announcement
        assert torn.parent == self.checkpoints, torn
        assert torn.name.startswith(f".tmp-step_{TORN_STEP}-"), torn.name
        contents = sorted(path.name for path in torn.iterdir())
        assert ".metadata" in contents and MARKER not in contents, contents
        assert not (self.checkpoints / f"step_{TORN_STEP}").exists()
        assert complete_steps(self.checkpoints)[-1] == TORN_STEP - INTERVAL
        return torn

    def assert_recovered(self, torn: Path) -> None:
        """Job 1 removed the torn save, saying so, resumed from the step before and finished."""
        log = job_log(self.id, 1)
        removed = re.escape(torn.name)
        assert re.search(rf"removing what earlier jobs left: [^\n]*{removed}", log), log
        previous = TORN_STEP - INTERVAL
        assert RESUMED.findall(log) == [
            (str(self.checkpoints / f"step_{previous}"), str(previous))
        ], log
        assert not torn.exists()
        assert metrics(self.run_dir)[-1]["step"] == MAX_STEPS


def test_a_save_killed_before_its_marker_is_torn_and_the_next_job_resumes_from_the_one_before(
    slurm_cluster, tmp_path, corpus
):
    """Two chains at once, saving every 2 steps, each job 0 killed while the test hook holds
    its save of step 4 before the marker: a sync save, the job cancelled (SIGTERM, then
    SLURM's SIGKILL after KillWait); an async save, inside its finalize, the training SIGKILLed
    at once. Each torn save is on disk after the kill; job 1 removes it, saying so, resumes
    from step 2 and finishes."""
    chains = [
        TornChain.launch(tmp_path / "sync", corpus),
        TornChain.launch(
            tmp_path / "async",
            corpus,
            "checkpoint.async_save=true",
            how=("--signal=KILL",),
            target=".0",
            killed_state="FAILED",
        ),
    ]
    torn: dict[TornChain, Path] = {}
    while len(torn) < len(chains):  # in the order the pauses come
        due = wait_until(
            lambda: next((c for c in chains if c not in torn and c.announcement.exists()), None),
            400,
            "the next save to pause",
        )
        torn[due] = due.tear()

    # squeue is cheap; `orchestrator status` (wait_chain) costs a Python start per poll.
    wait_gone([job["job_id"] for chain in chains for job in chain.summary["jobs"]], 600)
    for chain in chains:
        final = wait_chain(chain.id, timeout=60)
        assert [job["state"] for job in final["jobs"]] == [chain.killed_state, "COMPLETED"], final
        chain.assert_recovered(torn[chain])


def metrics_or_none(run_dir: Path) -> list[dict]:
    return metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
