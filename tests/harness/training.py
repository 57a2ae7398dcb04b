"""The trainer run as jobs run it (``python -m train`` on gloo ranks, forked from the test
process's zygote: harness/process.run_python) on the test corpus, or built in the test's own
process, and what its runs leave: metrics rows and checkpointed weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from contract.run_dir import RECORD_KEYS as JOB_RECORD_KEYS
from tests.harness.process import REPO, run_python

if TYPE_CHECKING:
    from train.trainer import Trainer

# The overrides that run training (``python -m train``) and decoding (``python -m
# train.evaluate``) under the device trap: a tensor made without its device fails on the CPU as
# on a GPU (train/loop/device_trap.py).
TRAPPED_TRAINING = "debug.device_trap=true"
TRAPPED_DECODING = "device_trap=true"
# A SIGKILLed rank's peers, and its job, end within this (docs/faults.md): 3-7 s measured on a
# busy 2-core machine, held here under torchrun's 30-s SIGKILL of a rank that ignores its SIGTERM
# (a rank stuck in a collective would take that long), with room for a machine loaded by other
# runs. On a machine so loaded that the job's own start took longer, that start is the bound:
# ending a run (an interpreter's shutdown, torchrun's exit, the end hook) slows with the load as
# starting one does. Callers check the survivors' exit 6 (a failed collective, no kill) besides.
KILLED_RANK_ENDS_JOB_S = 20


def train(
    run_dir: Path,
    corpus: Path,
    *overrides: str,
    nproc: int = 1,
    config: str = "tiny_fsdp2",
    env: dict | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    args = ["-m", "train", "--config-name", config, *train_overrides(run_dir, corpus, *overrides)]
    return run_ranks(args, nproc, env, check)


def train_overrides(run_dir: Path, corpus: Path, *overrides: str) -> list[str]:
    """The test corpus with short batches, then ``overrides``."""
    return [
        f"run_dir={run_dir}",
        f"data.corpus={corpus}",
        "data.max_duration=8",
        "optim.warmup_steps=2",
        *overrides,
    ]


def trainer_in_process(run_dir: Path, corpus: Path, *overrides: str) -> Trainer:
    """The trainer ``python -m train`` builds from ``train_overrides(...)``, built in this
    process (on the one-rank process group the caller made) and started as a job starts it:
    restored or fresh with its pretrained weights, its encoder's outputs kept if configured.
    For tests that call its steps themselves."""
    from orchestrator.planner.plan_check import compose_training_config
    from train.loop.stop import StopRequest
    from train.trainer import Trainer, preflight

    cfg = compose_training_config(train_overrides(run_dir, corpus, *overrides))
    trainer = Trainer(cfg, preflight(cfg), torch.device("cpu"), StopRequest(0.0))
    trainer.restore()
    trainer.keep_encoder_outputs()
    return trainer


def train_together(
    runs: dict[Path, tuple[str, ...]],
    corpus: Path,
    nproc: int,
    config: str = "tiny_fsdp2",
    env: dict | None = None,
) -> subprocess.CompletedProcess[str]:
    """Each run (its run dir: its overrides) trained by one process group of ``nproc`` ranks, one
    after another (tests/harness/workers/trainer_runs_worker.py): the ranks' start-up is paid
    once, not per run. The spec lands beside the first run dir."""
    spec = {
        "config": config,
        "runs": [train_overrides(run_dir, corpus, *args) for run_dir, args in runs.items()],
    }
    path = next(iter(runs)).parent / f"{next(iter(runs)).name}.runs.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    return run_ranks(["-m", "tests.harness.workers.trainer_runs_worker", str(path)], nproc, env)


def run_ranks(
    args: list[str], nproc: int, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` on ``nproc`` ranks, forked from the test process's zygote
    (tests/harness/process.py): the return code is the code of the rank that failed first."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    completed = run_python(args, nproc, env)
    if check:
        # The error lines first, then the end of the output: a rank that died without one
        # (a signal) leaves its peers' "Connection closed by peer" as the only error line.
        causes = [line for line in completed.stderr.splitlines() if "Error" in line]
        assert completed.returncode == 0, "\n".join(
            [f"exit status {completed.returncode}", *causes[:20], completed.stderr[-3000:]]
        )
    return completed


# metrics.jsonl's rows that are records, not history: each job's memory row, and the row of a
# job that restarted the data epoch on a changed data layout (train/data/layout.py).
RECORD_KEYS = (*JOB_RECORD_KEYS, "data_layout_change")


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's training and validation rows (the RECORD_KEYS rows left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if not any(key in row for key in RECORD_KEYS)]


def metrics_or_empty(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return metrics(run_dir) if path.exists() else []


def wait_for_step(run_dir: Path, step: int, still_running=lambda: True, timeout: float = 240):
    """Wait until rank 0 has logged ``step``."""
    deadline = time.monotonic() + timeout
    while not any(row.get("step", 0) >= step for row in metrics_or_empty(run_dir)):
        assert still_running(), "the training ended before the rank could be stopped"
        assert time.monotonic() < deadline, f"no step {step} after {timeout} s"
        time.sleep(0.5)


def final_weights(run_dir: Path, step: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{run_dir.name}-{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step}", out)
    state = torch.load(out, weights_only=False)
    model = state.get("model", state)
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def wait_until(condition, timeout: float, what: str):
    """Poll ``condition`` every 0.1 s until it holds: well under a training step and under the
    seconds a killed rank's job has to end, without a busier loop's squeue calls and process scans
    taking the cores from the training it waits for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def training_rank(run_dir: Path) -> psutil.Process | None:
    """A rank of a run queued on the cluster (a child of torchrun), not torchrun itself."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if f"run_dir={run_dir}" not in cmdline or "torchrun" in cmdline:
            continue
        parent = process.parent()
        if "-m train" in cmdline and parent and "torchrun" in " ".join(parent.cmdline()):
            return process
    return None


@contextmanager
def two_ranks(
    run_dir: Path, corpus: Path, log: Path, *overrides: str, job_id: str
) -> Iterator[subprocess.Popen]:
    """2-rank training under torchrun, W&B off, stderr in ``log``, as job 0 of SLURM job
    ``job_id`` (so rank 0 would write its end-of-job record); on the way out no process of it
    is left, stopped ones included (the ranks have sessions of their own)."""
    argv = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        *("-m", "train", f"run_dir={run_dir}", f"data.corpus={corpus}"),
        *("data.max_duration=8", "wandb.enabled=false", "train.max_steps=1000", *overrides),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": job_id, "ORCH_JOB_INDEX": "0"}
    with log.open("w") as stderr:
        torchrun = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        yield torchrun
    finally:
        if torchrun.poll() is None:
            for child in psutil.Process(torchrun.pid).children(recursive=True):
                with suppress(psutil.Error):
                    child.kill()
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait()


def rank_processes(torchrun: int) -> dict[int, psutil.Process]:
    """torchrun's workers by rank (their RANK environment variable)."""
    return {int(child.environ()["RANK"]): child for child in psutil.Process(torchrun).children()}


@contextmanager
def throttled(process: psutil.Process, stopped_s: float = 0.05, running_s: float = 0.05):
    """Slow ``process`` down from outside, as a throttled GPU or a busy node would: SIGSTOP and
    SIGCONT in turn (``stopped_s`` stopped, ``running_s`` running) until the block ends."""
    with throttling(lambda: [process], stopped_s, running_s):
        yield


def ranks_of(run_dir: Path) -> dict[psutil.Process, str]:
    """The training ranks of ``run_dir`` running now on the loopback cluster (not torchrun),
    each with the node SLURM runs it on (its SLURMD_NODENAME)."""
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if f"run_dir={run_dir}" not in cmdline or "-m train" not in cmdline:
            continue
        with suppress(psutil.Error):
            if "torchrun" not in cmdline and (node := process.environ().get("SLURMD_NODENAME")):
                found[process] = node
    return found


@contextmanager
def slow_node(node: str, run_dir: Path, stopped_s: float = 0.05, running_s: float = 0.05):
    """A slow SLURM node of the loopback cluster: every training rank of ``run_dir`` that
    runs there (its SLURMD_NODENAME), whichever job it belongs to, throttled as ``throttled``
    throttles one, until the block ends."""

    def ranks_on_node() -> list[psutil.Process]:
        return [rank for rank, where in ranks_of(run_dir).items() if where == node]

    with throttling(ranks_on_node, stopped_s, running_s, rescan_s=1.0):
        yield


@contextmanager
def throttling(
    targets, stopped_s: float, running_s: float, rescan_s: float | None = None
) -> Iterator[None]:
    """SIGSTOP and SIGCONT in turn the processes ``targets()`` lists (asked again every
    ``rescan_s``, else once) until the block ends; none is left stopped."""
    done = threading.Event()
    processes: list[psutil.Process] = []

    def each(action: str) -> None:
        for process in processes:
            with suppress(psutil.Error):
                getattr(process, action)()

    def cycle() -> None:
        scanned: float | None = None
        while not done.is_set():
            due = rescan_s is not None and time.monotonic() - (scanned or 0) >= rescan_s
            if scanned is None or due:
                processes[:] = targets()
                scanned = time.monotonic()
            each("suspend")
            time.sleep(stopped_s)
            each("resume")
            done.wait(running_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        each("resume")
