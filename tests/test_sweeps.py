"""Hydra multirun sweeps on the loopback cluster: plain (submitit) and chained members.

Every test runs ``python -m train -m ...`` as a user would, trains the tiny model for a few
steps on a small real corpus, and reads the run dirs, manifests and queue the sweep left behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from contract.job_end import EXIT_CONFIG
from contract.run_dir import RECORD_KEYS
from tests.harness.chains import wait_chain
from tests.harness.cluster import queue_ids, wait_gone
from tests.harness.process import REPO, run_tool
from tests.harness.recorded_jobs import read_jsonl, recording_recipe
from tests.harness.wandb_runs import WANDB_OFFLINE

# Few, short steps: each member trains in seconds on one shared core. W&B is not what a sweep
# checks here (tests/test_metrics.py does); its start would cost every member seconds of CPU.
TINY = ("data.max_duration=8", "optim.warmup_steps=2", "checkpoint.interval=2")
NO_WANDB = "wandb.enabled=false"


def multirun(
    sweep_dir: Path,
    corpus: Path,
    *overrides: str,
    timeout: float = 300,
    env: dict | None = None,
    wandb: str = NO_WANDB,
):
    """``python -m train -m`` from the repository root, with the sweep under ``sweep_dir``;
    ``wandb``: the override that sets W&B (off unless a test looks at it)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "-m",
            f"hydra.sweep.dir={sweep_dir}",
            f"data.corpus={corpus}",
            *TINY,
            wandb,
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's training and validation rows (each job's records left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if not any(key in row for key in RECORD_KEYS)]


def sweep_id(stdout: str) -> str:
    match = re.search(r"^sweep (\S+):", stdout, re.MULTILINE)
    assert match, stdout
    return match.group(1)


def sweep_status(sweep: str) -> dict:
    completed = run_tool("orchestrator", "status", sweep, "--json")
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.slurm
@pytest.mark.slow
def test_submitit_sweep_trains_each_member_in_its_own_run_dir(empty_queue, corpus, tmp_path):
    """2 model sizes (a config group) at a non-default lr, each member 2 srun tasks that meet in
    one FSDP2 process group. Value sweeps (lr) are the stock and the chained launchers' below."""
    sweep_dir = tmp_path / "sweep"
    done = multirun(
        sweep_dir,
        corpus,
        "hydra/launcher=cpu_loopback",
        "train.max_steps=2",
        "optim.lr=3e-4",
        "model=tiny,small",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    members = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in members] == ["0", "1"]
    logs = "".join(p.read_text() for p in sweep_dir.glob(".submitit/*/*_log.err"))
    assert logs.count("layout world=2") == 2, logs[-3000:]
    seeds = set()
    sizes = []
    for run_dir in members:
        rows = metrics(run_dir)
        assert rows[-1]["step"] == 2, rows
        assert len({row["seed"] for row in rows}) == 1
        seeds.add(rows[0]["seed"])
        # The lr reaches every member (its logged peak); the model size shows in the checkpoint.
        assert max(row["lr"] for row in rows) == 3e-4, rows
        sizes.append(sum(p.stat().st_size for p in (run_dir / "checkpoints").rglob("*.distcp")))
    assert len(seeds) == 2
    assert sizes[0] < sizes[1], sizes  # member 0 is tiny, member 1 small


@pytest.mark.slurm
def test_stock_submitit_slurm_launcher_gives_members_their_own_run_dir_and_seed(
    empty_queue, corpus, tmp_path
):
    """hydra-submitit-launcher as shipped: the configs' defaults (run_dir = Hydra's output dir,
    seed from member_seed) keep members apart without any launcher of ours."""
    sweep_dir = tmp_path / "sweep"
    done = multirun(
        sweep_dir,
        corpus,
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=debug",
        "hydra.launcher.timeout_min=5",
        "train.max_steps=2",
        "optim.lr=1e-3,3e-4",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {name: metrics(sweep_dir / name) for name in ("0", "1")}
    assert all(member[-1]["step"] == 2 for member in rows.values())
    assert rows["0"][0]["seed"] != rows["1"][0]["seed"]
    assert {max(row["lr"] for row in member) for member in rows.values()} == {1e-3, 3e-4}


@pytest.mark.slurm
@pytest.mark.slow
def test_chained_sweep_returns_at_once_and_each_member_resumes(empty_queue, corpus, tmp_path):
    """2 members x 2 chained jobs of a step each, queued as one job array per link: the
    launcher returns with the jobs queued; job 1 resumes, in the member's W&B run (offline);
    then each member's --then job runs in the member's run dir, given its seed alone."""
    sweep_dir = tmp_path / "sweep"
    evaluate = recording_recipe(tmp_path / "evaluate.sub")
    done = multirun(
        sweep_dir,
        corpus,
        "hydra/launcher=chain_loopback",
        "hydra.launcher.n=2",
        f"hydra.launcher.then={evaluate}",
        "train.max_steps=2",
        "train.max_steps_per_run=1",
        "optim.lr=1e-3,3e-4",
        wandb=WANDB_OFFLINE,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = sweep_id(done.stdout)
    status = sweep_status(sweep)
    assert status["sweep_id"] == sweep
    assert len(status["chains"]) == 2
    states = [job["state"] for chain in status["chains"] for job in chain["jobs"]]
    assert len(states) == 6
    assert all(state in ("PENDING", "RUNNING") for state in states), states

    wandb_runs: list[set[str]] = []
    # squeue is cheap; `orchestrator status` (wait_chain) costs a Python start per poll.
    wait_gone([job["job_id"] for chain in status["chains"] for job in chain["jobs"]], 240)
    for chain in status["chains"]:
        finished = wait_chain(chain["chain_id"], timeout=60)
        assert [job["state"] for job in finished["jobs"]] == ["COMPLETED"] * 3, finished
        run_dir = Path(chain["run_dir"])
        rows = metrics(run_dir)
        assert [row["step"] for row in rows] == [1, 2]
        assert [row["job_index"] for row in rows] == [0, 1]
        seeds = [job["seed"] for job in chain["jobs"]]
        assert [row["seed"] for row in rows] == [seeds[0], seeds[1]]
        tasks = [job["job_id"] for job in chain["jobs"][:2]]
        assert [row["slurm_job_id"] for row in rows] == tasks  # <array id>_<member>
        assert {row["chain_id"] for row in rows} == {chain["chain_id"]}
        runs = {path.name for path in (run_dir / "wandb").glob("offline-run-*/run-*.wandb")}
        assert len(runs) == 1, runs  # both links in the member's one W&B run
        wandb_runs.append(runs)
        (then,) = read_jsonl(run_dir / "jobs.jsonl")
        assert then["argv"] == [str(seeds[2])], then  # its seed alone, not the overrides
        assert then["env"]["ORCH_RUN_DIR"] == str(run_dir)
        assert then["env"]["ORCH_JOB_INDEX"] == "2"
        assert then["env"]["ORCH_SWEEP_ID"] == sweep
    assert wandb_runs[0] != wandb_runs[1], wandb_runs  # a run per member
    run_dirs = {Path(chain["run_dir"]) for chain in status["chains"]}
    assert run_dirs == {sweep_dir / "0", sweep_dir / "1"}
    script = (sweep_dir / "0" / "tiny_fsdp2.sub").read_text()
    assert 'optim.lr=0.001 seed="${SEED}" run_dir="${ORCH_RUN_DIR}"' in script
    logs = run_tool("orchestrator", "logs", sweep)
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.count("[orch] training exited with status 0") == 4  # 2 jobs x 2 members


@pytest.mark.slurm
def test_cancel_stops_every_chain_of_a_sweep(empty_queue, corpus, tmp_path):
    """Each member's chain ends with its own --then job and may queue replacements, as
    auto_launch --retries; cancel --member stops one member's chain and the other goes on;
    cancel stops all of them. A member the sweep lacks, or --member of a chain: one line,
    exit 2, nothing cancelled."""
    sweep_dir = tmp_path / "sweep"
    done = multirun(
        sweep_dir,
        corpus,
        "hydra/launcher=chain_loopback",
        "hydra.launcher.n=3",
        "hydra.launcher.retries=2",
        f"hydra.launcher.then={recording_recipe(tmp_path / 'evaluate.sub')}",
        "train.max_steps=1000",
        "optim.lr=1e-3,3e-4",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = sweep_id(done.stdout)
    chains = sweep_status(sweep)["chains"]
    for member, chain in enumerate(chains):
        jobs = chain["jobs"]
        assert [job["then"] for job in jobs] == [False, False, False, True]
        # One array per link: each task waits on its own member's task of the link before.
        arrays = [job["job_id"].partition("_")[0] for job in jobs]
        assert [job["job_id"] for job in jobs] == [f"{array}_{member}" for array in arrays]
        assert [job["dependency"] for job in jobs] == [
            None,
            *(f"aftercorr:{array}" for array in arrays[:3]),
        ]
        run_dir = sweep_dir / str(member)
        saved = json.loads((run_dir / "manifest.json").read_text())
        assert saved["then"]["script"] == str(run_dir / "then-evaluate.sub")
        assert saved["retries"] == 2
    job_ids = [job["job_id"] for chain in chains for job in chain["jobs"]]
    assert len(job_ids) == 8
    for wrong, error in (
        ([sweep, "--member", "2"], f"error: --member 2: sweep {sweep} has members 0..1"),
        ([chains[0]["chain_id"], "--member", "0"], "is no sweep; a chain is cancelled whole"),
    ):
        refused = run_tool("orchestrator", "cancel", *wrong)
        assert refused.returncode == 2 and error in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert set(job_ids) <= set(queue_ids())
    one = run_tool("orchestrator", "cancel", sweep, "--member", "1")
    assert one.returncode == 0, one.stderr
    head, _, ids = one.stdout.strip().partition(" job(s) ")
    assert head == f"chain {chains[1]['chain_id']}: cancelled 4", one.stdout
    assert sorted(ids.split()) == sorted(job_ids[4:]), one.stdout
    wait_gone(job_ids[4:])
    assert set(job_ids[:4]) <= set(queue_ids())  # member 0 goes on
    cancelled = run_tool("orchestrator", "cancel", sweep)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.count("cancelled 4 job(s)") == 1, cancelled.stdout
    assert cancelled.stdout.count("cancelled 0 job(s)") == 1, cancelled.stdout
    wait_gone(job_ids)


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (
            ["hydra/launcher=chain_loopback", "hydra.launcher.n=0", "optim.lr=1e-3,3e-4"],
            ["error: -n 0: a chain needs at least 1 job"],
        ),
        (
            ["hydra/launcher=chain_loopback", "parallel.tp=1,3"],
            ["error: sweep member #1 (", "parallel.tp=3)", "(on 1 rank(s))"],
        ),
        (
            ["hydra/launcher=cpu_loopback", "optim.lr=1e-3,-1"],
            ["error: sweep member #1 (", "optim.lr=-1", "must be positive"],
        ),
        (
            ["hydra/launcher=chain_loopback", "hydra.launcher.cpus_per_task=9", "optim.lr=1,2"],
            ["error: 1 tasks x 9 CPUs per node asked"],
        ),
        (
            ["hydra/launcher=chain_loopback", "hydra.launcher.then=no/eval.yaml", "optim.lr=1,2"],
            ["error: hydra.launcher.then: recipe no/eval.yaml does not exist"],
        ),
        (
            [
                "hydra/launcher=chain_loopback",
                "hydra.launcher.retries=2",
                "hydra.launcher.dependency=afterok",
                "optim.lr=1,2",
            ],
            ["error: --retries needs --dependency afterany or singleton"],
        ),
        (
            # An hour of audio per batch through the 1B LLM: no host holds its activations.
            [
                "hydra/launcher=chain_loopback",
                "model.preset=llm_1b",
                "data.max_duration=3600",
                "optim.lr=1e-3,3e-4",
            ],
            [
                "error: plan check: sweep member #0 (",
                "GiB per rank",
                "hydra.launcher.plan_check=false",
            ],
        ),
    ],
    ids=[
        "zero-jobs",
        "bad-layout",
        "bad-value",
        "too-big",
        "bad-then",
        "retries-afterok",
        "cannot-fit",
    ],
)
def test_bad_settings_stop_before_anything_is_queued(
    empty_queue, corpus, tmp_path, overrides, fragments
):
    """Refused by the submitting process, which never loads torch (a login node need not have
    it): ``-X importtime`` lists its imports."""
    imports = {"PYTHONPROFILEIMPORTTIME": "1"}
    done = multirun(tmp_path / "sweep", corpus, *overrides, timeout=120, env=imports)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert all(fragment in errors[0] for fragment in fragments), errors
    assert queue_ids() == []
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "train.config" in imported
    assert not [name for name in imported if name.split(".")[0] == "torch"]


@pytest.mark.slurm
def test_a_misspelt_launcher_preset_is_one_error_with_the_one_meant(empty_queue, corpus, tmp_path):
    """Hydra's reason on one line, the preset it probably meant, and a bad config's exit code."""
    done = multirun(tmp_path / "sweep", corpus, "hydra/launcher=chain_loopbak", "optim.lr=1,2")
    assert done.returncode == EXIT_CONFIG, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: In 'hydra/config': Could not find 'hydra/launcher/chain_loopbak'; did you mean "
        "hydra/launcher=chain_loopback?"
    ], done.stderr[-3000:]
    assert queue_ids() == []
