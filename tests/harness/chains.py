"""Chains as a user makes them (``auto_launch``, hand-written .sub recipes) and the waits for
their jobs to end, on any backend."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

from contract.slurm_states import END_STATES
from tests.harness.cluster import queue_ids, queue_reasons
from tests.harness.process import REPO, run_tool


def launch_json(
    *args: str, cwd: Path | None = None, env: dict | None = None, exit_code: int = 0
) -> dict:
    """Run auto_launch --json, expecting ``exit_code`` (3: a local chain that failed), and
    return its summary (its last line)."""
    completed = run_tool("auto_launch", "--json", *args, cwd=cwd, env=env)
    assert completed.returncode == exit_code, completed.stderr + completed.stdout
    return json.loads(completed.stdout.strip().splitlines()[-1])


def launch_training(jobs: int, run_dir: Path, recipe: str, corpus: Path, *overrides: str) -> dict:
    """Submit a chain of ``recipe`` on the test corpus (short batches)."""
    return launch_json(
        f"-n{jobs}",
        "--run-dir",
        str(run_dir),
        recipe,
        "--",
        f"data.corpus={corpus}",
        "data.max_duration=8",
        *overrides,
        cwd=REPO,
    )


def tiny_training_chain(
    run_dir: Path,
    corpus: Path,
    jobs: int,
    retries: int,
    *overrides: str,
    env: dict | None = None,
    launch_args: tuple[str, ...] = (),
    recipe: str = "recipes/train_tiny_fsdp2.yaml",
) -> dict:
    """``auto_launch`` of the tiny FSDP2 recipe (2 ranks; or ``recipe``, a variant of it) on
    ``corpus``; ``env`` reaches the jobs (sbatch exports the submitting
    environment)."""
    return launch_json(
        f"-n{jobs}",
        "--retries",
        str(retries),
        "--run-dir",
        str(run_dir),
        *launch_args,
        recipe,
        "--",
        f"data.corpus={corpus}",
        "data.max_duration=8",
        *overrides,
        cwd=REPO,
        env=env,
    )


# A stand-in for the trainer in a .sub, as cheap as a shell: it runs the chain hook as the
# rendered scripts do, and ends as $CODE says with the end-of-job record a trainer writes
# (contract/job_end.py): a complete checkpoint at step $SAVE where set (the step reached, of
# $MAX_STEPS, default 8: finished when they meet), and $ERROR as its error line.
STAND_IN_TRAINER = """
hook=0
"$ORCH_PYTHON" -m orchestrator.chain_hooks start || hook=$?
if [ "$hook" = 100 ]; then exit 0; fi
step=${SAVE:-0}
saved_dir="$ORCH_RUN_DIR/checkpoints/step_$step"
if [ -n "${SAVE:-}" ]; then mkdir -p "$saved_dir" && touch "$saved_dir/COMPLETE"; fi
"$ORCH_PYTHON" -c '
import os
from contract.job_end import job_end_record, write_job_end
record = job_end_record(
    int(os.environ["CODE"]), step=int(os.environ.get("SAVE") or 0),
    max_steps=int(os.environ.get("MAX_STEPS") or 8), signalled=False, signal_name=None,
    diverged=False, error=os.environ.get("ERROR"),
)
write_job_end(os.environ["ORCH_RUN_DIR"], record)
'
if [ -n "${ERROR:-}" ]; then echo "error: $ERROR" >&2; fi
"$ORCH_PYTHON" -m orchestrator.chain_hooks end "$CODE" ||
  echo "[orch] training exited with status $CODE"
exit "$CODE"
"""


def write_sub(path: Path, body: str, directives: str = "#SBATCH --time=00:05:00") -> Path:
    """A hand-written NeMo-style .sub: #SBATCH lines, SEED=$1 required, then ``body``."""
    path.write_text(
        "#!/bin/bash\n"
        + directives.strip()
        + "\n"
        + 'SEED=${1:?"usage: $0 SEED [args]: the job seed is required"}\n'
        + textwrap.dedent(body).lstrip()
    )
    return path


def chain_status(chain: str) -> dict:
    completed = run_tool("orchestrator", "status", chain, "--json")
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def wait_chain(chain: str, timeout: float = 180) -> dict:
    """Poll until every job has finished, or the first unfinished one can never start. The
    chain's status (a Python start and accounting queries: ~0.35 CPU-s, a share of a core beside
    the jobs it waits for) is asked every second; on SLURM, only once squeue (a C client, every
    half second) no longer shows a job it waits for queued, or shows one that can never start
    (a job's replacement, added by its hook, is in the next status)."""
    deadline = time.monotonic() + timeout
    while True:
        status = chain_status(chain)
        waiting = [job for job in status["jobs"] if job["state"] not in END_STATES]
        if not waiting or "DependencyNeverSatisfied" in waiting[0]["reason"]:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"chain {chain} not finished after {timeout} s: {status}")
        ids, waited = {job["job_id"] for job in waiting}, False
        while (
            "slurm" in status["backend"]
            and time.monotonic() < deadline
            and (reasons := [r for i, r in queue_reasons().items() if i in ids])
        ):
            if any("DependencyNeverSatisfied" in reason for reason in reasons):
                break
            waited = True
            time.sleep(0.5)
        if not waited:  # not on SLURM, or ended there but not yet in accounting
            time.sleep(1)


def wait_chain_quietly(run_dir: Path, chain_id: str, timeout: float = 180) -> dict:
    """``wait_chain`` without its poll of ``orchestrator status`` every second (a Python start
    and accounting queries each, a share of a core beside the jobs it waits for): squeue (a C
    client) every half second until no job of the chain's manifest is queued, replacements
    and ``--then`` jobs included (a job's hook adds its replacement while the job still runs),
    then the chain's status, polled as ``wait_chain`` does until accounting has every end."""
    deadline = time.monotonic() + timeout
    while set(queue_ids()) & {
        job["job_id"] for job in json.loads((run_dir / "manifest.json").read_text())["jobs"]
    }:
        assert time.monotonic() < deadline, f"chain {chain_id} still queued after {timeout} s"
        time.sleep(0.5)
    return wait_chain(chain_id, timeout=max(30.0, deadline - time.monotonic()))
