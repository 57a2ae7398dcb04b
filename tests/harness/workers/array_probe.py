"""A job of a chained sweep that records what it saw and ends the way its member is told.

Run as ``python tests/harness/workers/array_probe.py`` by a YAML recipe's command (the real
templates, chain hooks and all). ``PROBE_PLAN`` (JSON, from the launching environment) maps
``"<member>:<job index>"`` to how that job ends; any other job sleeps a second and exits 0:

- ``fail``: exit 1 (an error of the training's own: not retried);
- ``kill``: SIGKILL itself (a rank killed: retried);
- ``stop``: wait for the stop-at time the batch script sets before the time limit, then save
  and stop as the trainer does (an end-of-job record, exit 0);
- ``die``: its batch shell killed by SIGKILL (as on a lost node): no end hook runs.

Each job first appends ``{member, index, seed, job_id, start, end}`` to RUN_DIR/probe.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from contract import job_env
from contract.job_end import job_end_record, write_job_end

PLAN_ENV = "PROBE_PLAN"
RECORDS = "probe.jsonl"


def main() -> int:
    run_dir = Path(os.environ[job_env.RUN_DIR])
    member = os.environ[job_env.CHAIN_ID].rpartition("-")[2]
    index = os.environ[job_env.JOB_INDEX]
    how = json.loads(os.environ.get(PLAN_ENV, "{}")).get(f"{member}:{index}", "ok")
    start = time.time()
    if how == "stop":
        stop_at = float(os.environ[job_env.STOP_AT])
        while time.time() < stop_at:
            time.sleep(0.2)
    else:
        time.sleep(1)
    record = {
        "member": int(member),
        "index": int(index),
        "seed": int(os.environ["SEED"]),
        "job_id": job_env.job_id(os.environ),
        "how": how,
        "start": start,
        "end": time.time(),
    }
    with open(run_dir / RECORDS, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    if how == "fail":
        return 1
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "stop":
        saved = job_end_record(
            0, step=1, max_steps=10, signalled=True, signal_name="SIGUSR1", diverged=False
        )
        write_job_end(run_dir, saved)
    if how == "die":
        job = os.environ["SLURM_JOB_ID"]
        subprocess.run(["scancel", "--batch", "--signal=KILL", job], check=True)
        time.sleep(60)  # the job's end takes this process with it
    return 0


if __name__ == "__main__":
    sys.exit(main())
