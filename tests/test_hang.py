"""A rank that stops mid-training (SIGSTOP: it cannot act, its peer waits in a collective) ends
the job within ``train.hang_timeout_s`` with exit code 5, not at the job's time limit, whichever
rank it is and whether it stops in a step, a checkpoint save or validation; a stop signal shortens
the wait; and the job launches the training again in place, which resumes from the last
checkpoint (orchestrator/in_job.py).

The hangs here (four of 2-rank torchrun, one chain on the loopback cluster) mostly wait: for a
watchdog, a stop signal's patience, torchrun's removal of a stopped rank. ``hung_runs`` starts
them together, each driven by a thread of its own, so that the module waits about as long as the
longest of them; each test then checks its own run's outcome."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from contract.job_end import read_job_end
from orchestrator.chain_judgement import judge
from tests.harness.chains import launch_training, wait_chain
from tests.harness.process import run_tool
from tests.harness.training import metrics, rank_processes, two_ranks, wait_for_step
from train.config import DebugConfig, TrainConfig, TrainLoopConfig, validate
from train.loop.watchdog import SIGNAL_PATIENCE_S, STOPPABLE

TORCHRUN_KILL_S = 30  # torchrun SIGKILLs a rank that its SIGTERM did not end after this long
MARGIN_S = 30  # polling, teardown and a loaded 2-core machine
# With this module's hangs all running at once on a 2-core machine busy with other tests, the
# tiny model's steps, saves and validations took up to 4 s (1.2 s alone): 5x that, so that no
# slow step is taken for a hang; the tests also check that no watchdog fired before its time.
HANG_TIMEOUT_S = 20
HUNG_LINE = "error: rank 0: the job is hung"  # rank 1 stopped
JOB_ID = "4242"  # a SLURM job id for the end-of-job record (contract/job_end.py) outside SLURM
# The local hangs by test id: which rank is stopped after step 3, with what train.hang_timeout_s,
# and whether the other rank then gets SIGUSR1 ...
STOPPED_RANK = {"rank0-timeout": (0, HANG_TIMEOUT_S, False), "rank1-usr1": (1, 600, True)}
# ... and which rank stops itself (debug.stop_in) in which phase at step 2, with what overrides.
HUNG_PHASE = {
    "rank1-save": ("save", 1, ("checkpoint.interval=2",)),
    "rank0-validation": ("validation", 0, ("eval.interval=2",)),
}
CHAIN_TEST = "test_a_job_restarts_its_training_in_place_after_a_rank_hangs"
CHAIN_STEPS, CHAIN_INTERVAL = 12, 4  # the chain's train.max_steps and checkpoint.interval
# A launch of the training again in the job: srun, torchrun and two ranks importing torch, 6 s
# alone, on a machine busy with the other hangs here and other tests' runs (test_in_job_restart
# times the restart itself).
RELAUNCH_S = 60


def rank_stopped(torchrun: int) -> list[psutil.Process]:
    """torchrun's workers that are stopped (SIGSTOP)."""
    found = []
    for rank in psutil.Process(torchrun).children():
        with suppress(psutil.Error):  # gone meanwhile
            if rank.status() == psutil.STATUS_STOPPED:
                found.append(rank)
    return found


def job_ranks(chain: str, job_index: int, rank: int) -> list[psutil.Process]:
    """The training processes of one rank of one job of a chain on this machine."""
    found = []
    for process in psutil.process_iter():
        with suppress(psutil.Error):  # gone meanwhile, or not ours to read
            env = process.environ()
            if (
                process.cmdline()[1:3] == ["-m", "train"]
                and env.get("ORCH_CHAIN_ID") == chain
                and env.get("ORCH_JOB_INDEX") == str(job_index)
                and env.get("RANK") == str(rank)
            ):
                found.append(process)
    return found


@dataclass(frozen=True)
class Ended:
    """How a local hang ended: torchrun's exit code (None: still running), its stderr, and the
    seconds from the rank's stop to the end that the test waited for."""

    run_dir: Path
    returncode: int | None
    stderr: str
    took: float


def stop_a_rank(tmp: Path, corpus: Path, stopped: int, hang_timeout_s: int, usr1: bool) -> Ended:
    """2-rank training SIGSTOPs rank ``stopped`` after step 3 (and sends the other rank USR1):
    wait for torchrun to end, or with USR1 for the watchdog's line, then kill the stopped rank."""
    run_dir, log = tmp / "run", tmp / "stderr.log"
    overrides = ("checkpoint.interval=2", f"train.hang_timeout_s={hang_timeout_s}")
    with two_ranks(run_dir, corpus, log, *overrides, job_id=JOB_ID) as torchrun:
        wait_for_step(run_dir, 3, lambda: torchrun.poll() is None)
        ranks = rank_processes(torchrun.pid)
        ranks[stopped].suspend()
        paused = time.monotonic()
        if usr1:
            ranks[1 - stopped].send_signal(signal.SIGUSR1)
        expected = SIGNAL_PATIENCE_S if usr1 else hang_timeout_s
        if usr1:  # torchrun's removal of the stopped rank is timed by the rank0 case
            while "the job is hung" not in log.read_text() and torchrun.poll() is None:
                assert time.monotonic() - paused < expected + MARGIN_S, log.read_text()[-3000:]
                time.sleep(0.2)
            ranks[stopped].kill()
        with suppress(subprocess.TimeoutExpired):
            torchrun.wait(timeout=expected + TORCHRUN_KILL_S + MARGIN_S)
        took = time.monotonic() - paused
        returncode = torchrun.poll()
    return Ended(run_dir, returncode, log.read_text(), took)


def hang_in_a_phase(
    tmp: Path, corpus: Path, stop_in: str, stopped: int, overrides: tuple[str, ...]
) -> Ended:
    """2-rank training whose rank ``stopped`` stops itself as it begins its first ``stop_in``:
    wait for the other rank's watchdog line, then kill the stopped rank."""
    run_dir, log = tmp / "run", tmp / "stderr.log"
    faulty = (f"debug.stop_in={stop_in}", f"debug.stop_rank={stopped}")
    timeout = f"train.hang_timeout_s={HANG_TIMEOUT_S}"
    with two_ranks(run_dir, corpus, log, timeout, *faulty, *overrides, job_id=JOB_ID) as torchrun:
        deadline = time.monotonic() + 240
        while not rank_stopped(torchrun.pid):
            assert torchrun.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no rank stopped: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        paused = time.monotonic()
        while "the job is hung" not in log.read_text():
            in_time = time.monotonic() - paused < HANG_TIMEOUT_S + MARGIN_S
            assert in_time and torchrun.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        took = time.monotonic() - paused
        for rank in rank_stopped(torchrun.pid):  # sooner than torchrun would (tested above)
            rank.kill()
        returncode = torchrun.wait(timeout=MARGIN_S)
    return Ended(run_dir, returncode, log.read_text(), took)


def hang_a_chain(tmp: Path, corpus: Path) -> tuple[Path, str, dict]:
    """A chain of 2 jobs whose job 0 has rank 1 SIGSTOPped after step 5, 7 steps before it
    would end: wait for the watchdog's line, kill the stopped rank (sooner than torchrun would:
    timed by test_a_stopped_rank_ends_the_run), then for job 0's training to step again (launched
    again in place) and the chain's end. Its run dir, chain id and final status."""
    run_dir = tmp / "run"
    summary = launch_training(
        2,
        run_dir,
        "recipes/train_tiny_fsdp2.yaml",
        corpus,
        f"train.max_steps={CHAIN_STEPS}",
        f"checkpoint.interval={CHAIN_INTERVAL}",
        f"train.hang_timeout_s={HANG_TIMEOUT_S}",
    )
    chain = summary["chain_id"]
    wait_for_step(run_dir, 5)
    [stopped] = job_ranks(chain, job_index=0, rank=1)
    stopped.suspend()
    paused = time.monotonic()
    try:
        while not any(HUNG_LINE in log.read_text() for log in (run_dir / "logs").glob("*.out")):
            assert time.monotonic() - paused < HANG_TIMEOUT_S + 2 * MARGIN_S, (
                "no watchdog fired while a rank was stopped"
            )
            time.sleep(0.5)
        stopped.kill()
        killed = time.monotonic()
        while not any(row.get("in_job_restart") for row in metrics(run_dir)):
            assert time.monotonic() - killed < MARGIN_S + RELAUNCH_S, (
                f"job 0 trains no step again {MARGIN_S + RELAUNCH_S} s after its watchdog fired "
                "and its stopped rank was killed"
            )
            time.sleep(0.5)
        return run_dir, chain, wait_chain(chain, timeout=400)
    finally:
        with suppress(psutil.Error):
            stopped.kill()


@pytest.fixture(scope="module")
def hung_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, corpus: Path
) -> Iterator[dict[str, Future]]:
    """The hangs of the tests selected in this session, by test id (the chain's by its test's
    name), all started at once, each driven by a thread: their waits overlap. A failure inside
    one is raised by its test. The loopback cluster is started only for the chain."""
    selected = {
        item.callspec.id if hasattr(item, "callspec") else item.originalname
        for item in request.session.items
        if item.module is request.module
    }
    runs = [
        (CHAIN_TEST, hang_a_chain, ()),  # first: its jobs start slowest
        *((case, stop_a_rank, args) for case, args in STOPPED_RANK.items()),
        *((case, hang_in_a_phase, args) for case, args in HUNG_PHASE.items()),
    ]
    runs = [run for run in runs if run[0] in selected]
    if CHAIN_TEST in selected:
        request.getfixturevalue("slurm_cluster")
    with ThreadPoolExecutor(max_workers=max(1, len(runs))) as pool:
        yield {
            case: pool.submit(scenario, tmp_path_factory.mktemp(case), corpus, *args)
            for case, scenario, args in runs
        }


def test_a_negative_hang_timeout_is_refused():
    with pytest.raises(ValueError, match=r"train\.hang_timeout_s must be 0 \(no watchdog\)"):
        validate(TrainConfig(train=TrainLoopConfig(hang_timeout_s=-1)))


def test_an_unknown_stop_phase_is_refused():
    with pytest.raises(ValueError, match=r"debug\.stop_in=sleep: choose one of save, validation"):
        validate(TrainConfig(debug=DebugConfig(stop_in="sleep")))


@pytest.mark.parametrize(
    "case", ["rank0-timeout", pytest.param("rank1-usr1", marks=pytest.mark.slow)]
)
def test_a_stopped_rank_ends_the_run(hung_runs, case):
    """A rank SIGSTOPped after step 3: the other rank's watchdog ends the run with one line and
    exit 5, after hang_timeout_s (or, once USR1 came, after SIGNAL_PATIENCE_S in a step), and
    torchrun removes the stopped rank. Without the watchdog gloo would wait 30 minutes. The rank
    whose watchdog fired writes the end-of-job record (exit 5), rank 0 or not: the chain's hook
    judges the job a failure a new job can fix (retried; the next job resumes)."""
    stopped, hang_timeout_s, usr1 = STOPPED_RANK[case]
    expected = SIGNAL_PATIENCE_S if usr1 else hang_timeout_s
    ended = hung_runs[case].result()
    returncode, stderr, took = ended.returncode, ended.stderr, ended.took
    assert returncode is not None, f"still running {took:.0f} s after the stop: {stderr[-3000:]}"
    assert returncode != 0 and "exitcode  : 5" in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith(f"error: rank {1 - stopped}: the job is hung"), errors[0]
    assert f"train.hang_timeout_s={hang_timeout_s}" in errors[0]
    assert ("SIGUSR1 came" in errors[0]) == usr1, errors[0]
    assert took > expected - 5, f"the watchdog fired after {took:.0f} s, before its timeout"
    record = read_job_end(ended.run_dir, "0", JOB_ID)
    assert record is not None and record["exit_code"] == 5, record
    assert f"error: {record['error']}" == errors[0].rstrip()  # what the chain's status shows
    ending = judge(record, returncode, "", True)
    assert ending.outcome == "failed" and ending.retry and errors[0] in ending.line, ending


@pytest.mark.parametrize("case", HUNG_PHASE)
def test_a_rank_hung_in_a_save_or_validation_ends_the_run(hung_runs, case):
    """A rank stops itself (debug.stop_in: SIGSTOP) as it begins its first save, or validation,
    at step 2. The other rank waits for it inside that phase; its watchdog names the phase and
    exits 5 after hang_timeout_s."""
    stop_in, stopped, _ = HUNG_PHASE[case]
    ended = hung_runs[case].result()
    stderr, timeout = ended.stderr, f"train.hang_timeout_s={HANG_TIMEOUT_S}"
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith(f"error: rank {1 - stopped}: the job is hung: no progress for ")
    assert f" s in {STOPPABLE[stop_in]} after step 2 ({timeout})" in errors[0], errors[0]
    took = ended.took
    assert took > HANG_TIMEOUT_S - 5, f"the watchdog fired after {took:.0f} s, before its timeout"
    assert ended.returncode != 0 and "exitcode  : 5" in stderr, stderr[-3000:]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_restarts_its_training_in_place_after_a_rank_hangs(hung_runs):
    """2 jobs of 2-rank training on the loopback cluster: a rank of job 0 stopped after step 5
    ends job 0's training within hang_timeout_s (its time limit is 10 minutes) with exit 5
    named; job 0 launches the training again in place (the hang's rung: no new job), which
    resumes from the last checkpoint, losing at most one interval, and finishes; job 1, not
    needed, is cancelled unstarted."""
    run_dir, chain, final = hung_runs[CHAIN_TEST].result()
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED", "CANCELLED"], final
    logs = run_tool("orchestrator", "logs", chain).stdout
    assert HUNG_LINE in logs and "exitcode  : 5" in logs, logs[-3000:]
    assert "(exit 5): a rank hung: restarting the training in place (1 of 2)" in logs
    resumed = re.search(rf"resumed from {run_dir}/checkpoints/step_(\d+) at step", logs)
    assert resumed, logs[-3000:]
    rows = [row for row in metrics(run_dir) if "loss" in row]
    before = [row["step"] for row in rows if not row.get("in_job_restart")]
    after = [row["step"] for row in rows if row.get("in_job_restart") == 1]
    saved = int(resumed.group(1))
    assert {row["job_index"] for row in rows} == {0}
    assert before[-1] - saved <= CHAIN_INTERVAL, (saved, before)
    assert after == list(range(saved + 1, CHAIN_STEPS + 1)), (saved, after)
