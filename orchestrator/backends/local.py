"""The local backend: a chain's jobs run one after another on this machine.

It is the embedded default where no SLURM answers. Each job runs as ``bash SCRIPT SEED ARGS`` with
the ORCH_* contract and the SLURM_* variables of a one-node allocation, ``srun``/``scontrol``
stand-ins first on PATH, its log appended to the run dir, and the script's own ``--time`` and
``--signal`` honoured (the signal arrives ``grace`` seconds before the limit, as on SLURM).
``submit`` returns when the job has finished; the result is kept under ``$ORCH_HOME/local_jobs``.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from contract import job_env
from contract.job_end import read_job_end
from orchestrator.backends.base import BatchScriptBackend, JobRequest, JobStatus
from orchestrator.manifest import atomic_write_json, orch_home
from orchestrator.processes import group_and_descendants, terminate
from orchestrator.slurm.directives import parse_sbatch_directives, parse_signal
from orchestrator.slurm.time_limit import format_elapsed, parse_time_minutes

KILL_WAIT_S = 10


def jobs_dir() -> Path:
    return orch_home() / "local_jobs"


def next_job_id() -> str:
    """A numeric id unique under ORCH_HOME (templates derive ports from it, as on SLURM).

    The first id is random, so that two ORCH_HOMEs on one machine rarely share ports.
    """
    folder = jobs_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "counter.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        counter = folder / "counter"
        value = int(counter.read_text()) + 1 if counter.exists() else 1 + secrets.randbelow(19_000)
        counter.write_text(str(value))
    return str(value)


def write_shims(folder: Path) -> None:
    """``srun`` and ``scontrol`` scripts in ``folder`` that call orchestrator.local_shims."""
    for tool in ("srun", "scontrol"):
        path = folder / tool
        path.write_text(
            f'#!/bin/sh\nexec "{sys.executable}" -m orchestrator.local_shims {tool} "$@"\n'
        )
        path.chmod(0o755)


def job_environment(request: JobRequest, job_id: str, directives: dict[str, str]) -> dict[str, str]:
    tasks_per_node = int(directives.get("ntasks-per-node") or directives.get("ntasks") or 1)
    env = dict(os.environ)
    env.update(request.env)
    env.update(
        SLURM_JOB_ID=job_id,
        SLURM_JOBID=job_id,
        SLURM_JOB_NAME=request.job_name,
        SLURM_JOB_NODELIST="localhost",
        SLURM_NODELIST="localhost",
        SLURM_NNODES="1",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NODEID="0",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NTASKS=str(tasks_per_node),
        SLURM_NTASKS_PER_NODE=str(tasks_per_node),
        SLURM_CPUS_PER_TASK=directives.get("cpus-per-task", "1"),
        SLURM_CPUS_ON_NODE=str(os.cpu_count() or 1),
        SLURM_SUBMIT_DIR=str(request.workdir),
        SLURM_SUBMIT_HOST=socket.gethostname(),
        SLURMD_NODENAME="localhost",
        SLURM_CLUSTER_NAME="local",
        SLURM_JOB_PARTITION="local",
        SLURM_LAUNCH_NODE_IPADDR="127.0.0.1",
    )
    return env


class LocalBackend(BatchScriptBackend):
    label = "local"
    option = "local"
    auto = True  # when no SLURM controller answers
    runs_here = True
    judged = True  # by auto_launch, as each job ends (chain_hooks.judge_local_job)

    def command_line(self, request: JobRequest, after: str | None) -> list[str]:
        script = self.script_of(request)
        return ["bash", str(script), str(request.seed), *request.script_args]

    def test_only(self, request: JobRequest) -> str | None:
        return None

    def submit(self, request: JobRequest) -> str:
        job_id = next_job_id()
        previous = self.statuses([request.after])[request.after] if request.after else None
        if (
            request.dependency_kind == "afterok"
            and previous is not None
            and previous.state != "COMPLETED"
        ):
            status = JobStatus(job_id, "CANCELLED", reason="DependencyNeverSatisfied")
            self._record(status)
            self._say(f"job {job_id} not run: job {request.after} ended {previous.state} (afterok)")
            return job_id
        self._record(JobStatus(job_id, "RUNNING", nodes="localhost"))
        status = self._run(request, job_id)
        self._record(status)
        return job_id

    def cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            current = self.statuses([job_id])[job_id]
            if current.state in ("PENDING", "RUNNING"):
                self._record(JobStatus(job_id, "CANCELLED", reason="cancelled"))

    def statuses(self, job_ids: list[str], seen: Any = None) -> dict[str, JobStatus]:
        found: dict[str, JobStatus] = {}
        for job_id in job_ids:
            path = jobs_dir() / f"{job_id}.json"
            if path.exists():
                found[job_id] = JobStatus(**json.loads(path.read_text()))
            else:
                found[job_id] = JobStatus(job_id, "UNKNOWN", reason="no record of this local job")
        return found

    def _record(self, status: JobStatus) -> None:
        atomic_write_json(jobs_dir() / f"{status.job_id}.json", status.__dict__)

    def _say(self, line: str) -> None:
        print(f"[local] {line}", file=sys.stderr, flush=True)

    def _run(self, request: JobRequest, job_id: str) -> JobStatus:
        directives = parse_sbatch_directives(self.script_of(request).read_text())
        env = job_environment(request, job_id, directives)
        log_path = Path(
            str(request.log_pattern).replace("%j", job_id).replace("%x", request.job_name)
        )
        log_path.parent.mkdir(parents=True, exist_ok=True)
        limit_min = parse_time_minutes(directives["time"]) if directives.get("time") else None
        limit_s = None if limit_min is None else limit_min * 60
        signal_spec = parse_signal(directives["signal"]) if directives.get("signal") else None
        self._say(
            f"job {job_id} (index {request.env.get(job_env.JOB_INDEX)}, seed {request.seed}): "
            f"running, log {log_path}"
        )
        started = time.monotonic()
        with (
            tempfile.TemporaryDirectory(prefix="orch-local-shims-") as shims,
            open(log_path, "ab") as log,
        ):
            write_shims(Path(shims))
            env["PATH"] = f"{shims}{os.pathsep}{env.get('PATH', '')}"
            process = subprocess.Popen(
                self.command_line(request, request.after),
                cwd=request.workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            state = self._supervise(process, limit_s, signal_spec)
        elapsed = time.monotonic() - started
        code = process.returncode
        if state == "RUNNING":
            state = "COMPLETED" if code == 0 else "FAILED"
        run_dir, index = request.env.get(job_env.RUN_DIR), request.env.get(job_env.JOB_INDEX, "")
        record = read_job_end(run_dir, index, job_id) if run_dir else None
        said = f": error: {record['error']}" if record and record.get("error") else ""
        self._say(f"job {job_id}: {state} (exit {code}) after {elapsed:.1f} s{said}")
        return JobStatus(
            job_id, state, nodes="localhost", exit_code=code, elapsed=format_elapsed(elapsed)
        )

    def _supervise(
        self,
        process: subprocess.Popen[bytes],
        limit_s: float | None,
        signal_spec: tuple[bool, int, float] | None,
    ) -> str:
        """Wait for the job, sending its warning signal and enforcing its time limit."""
        started = time.monotonic()
        warned = False
        try:
            while process.poll() is None:
                elapsed = time.monotonic() - started
                if signal_spec and limit_s and not warned and elapsed >= limit_s - signal_spec[2]:
                    batch_only, number, _ = signal_spec
                    if batch_only:
                        process.send_signal(number)
                    else:
                        os.killpg(process.pid, number)
                    warned = True
                if limit_s is not None and elapsed >= limit_s:
                    self._stop(process)
                    return "TIMEOUT"
                time.sleep(0.2)
        except KeyboardInterrupt:
            self._stop(process)
            raise
        return "RUNNING"

    def _stop(self, process: subprocess.Popen[bytes]) -> None:
        """End the job's whole process tree: SIGTERM, then SIGKILL after KILL_WAIT_S."""
        terminate(group_and_descendants(process.pid), timeout_s=KILL_WAIT_S)
        process.wait()
