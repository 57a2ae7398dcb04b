"""A slow rank found and named (train/loop/straggler.py): each rank's compute time apart from its
time waiting in FSDP2's collectives, judged over a window of log intervals.

The judge's rules run on numbers; then 2-rank training (gloo, tiny model) runs twice as a job
would: as it is, naming nobody, and with rank 1 slowed from outside (SIGSTOP/SIGCONT, half of
every 0.1 s), named with its node within a bound, while both ranks' step times stay equal.
"""

from __future__ import annotations

import json
import signal
import socket
import statistics
import time

import pytest

from contract.job_end import job_end_path, job_end_record, read_job_end
from orchestrator.chain_hooks import ChainKeeper
from orchestrator.manifest import MANIFEST_NAME, Manifest
from tests.harness.process import run_tool
from tests.harness.results import make_chain, status_json, train_row
from tests.harness.training import metrics, rank_processes, throttled, two_ranks, wait_for_step
from train.config import StragglerConfig, TrainConfig, TrainLoopConfig, validate
from train.loop.straggler import Blame, StragglerJudge, interval_figures, ratios_to_others

# The judge's intervals here: 10 steps (production's default is 20), 3 in a row. Unthrottled
# under a loaded 2-core machine (this suite beside it), 10-step intervals measured 1.00-1.13x
# between the ranks; throttled, ~2x.
EVERY = 10
# Steps of the unthrottled run: two whole windows, as long as the throttled one is given.
STEPS = 60
# From the throttle's start to the blame line: up to 4 intervals (the one under way, then 3
# whole ones) of ~0.5 s throttled steps, with room for a machine loaded by other tests.
NAMED_WITHIN_S = 90
RUN = (
    "train.log_every=1",
    f"train.straggler.every={EVERY}",
    "checkpoint.interval=1000",
    "optim.warmup_steps=2",
)


def test_the_judge_names_the_rank_slowest_in_every_interval_of_its_window():
    judge = StragglerJudge(ratio=1.5, intervals=3)
    assert judge.observe([1.0, 2.0]) is None  # the window is not full yet
    assert judge.observe([1.0, 1.8]) is None
    blame = judge.observe([1.1, 2.2])
    assert blame == Blame(rank=1, ratio=pytest.approx(6.0 / 3.1), intervals=3)
    assert judge.observe([1.0, 2.0]) is None  # named once


@pytest.mark.parametrize(
    "rows",
    [
        [[1.0, 2.0], [2.0, 1.0], [1.0, 2.0]],  # the slowest changes
        [[1.0, 1.4], [1.0, 1.4], [1.0, 1.4]],  # slowest throughout, by less than the ratio
        [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]],
    ],
    ids=["slowest-changes", "under-the-ratio", "even"],
)
def test_the_judge_names_nobody_for_noise(rows):
    judge = StragglerJudge(ratio=1.5, intervals=3)
    assert [judge.observe(row) for row in rows] == [None] * 3


def test_the_judge_compares_with_the_other_ranks_median_and_can_be_off():
    assert ratios_to_others([1.0, 1.0, 1.0, 3.0]) == [1.0, 1.0, 1.0, 3.0]
    judge = StragglerJudge(ratio=1.5, intervals=2)
    assert judge.observe([1.0, 1.1, 0.9, 3.0]) is None
    assert judge.observe([1.0, 1.0, 1.0, 3.0]) == Blame(3, pytest.approx(6.0 / 2.0), 2)
    off = StragglerJudge(ratio=1.5, intervals=0)
    assert [off.observe([1.0, 9.0]) for _ in range(10)] == [None] * 10
    assert StragglerJudge(1.5, 1).observe([5.0]) is None  # one rank: nobody to wait
    figures = interval_figures([0.2, 0.5], [0.3, 0.0])
    assert figures["slowest_rank"] == 1 and figures["slowest_ratio"] == pytest.approx(2.5)
    assert figures["wait_s_max"] == 0.3


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"ratio": 1.0}, r"train\.straggler\.ratio=1\.0: must be above 1"),
        ({"intervals": -1}, r"train\.straggler\.intervals=-1: must be 0 \(never name a rank\)"),
        ({"every": 0}, r"train\.straggler\.every=0: must be at least 1 step"),
    ],
)
def test_bad_straggler_settings_are_refused(settings, error):
    with pytest.raises(ValueError, match=error):
        validate(TrainConfig(train=TrainLoopConfig(straggler=StragglerConfig(**settings))))


def test_a_throttled_rank_is_named_and_an_even_run_names_nobody(corpus, tmp_path):
    even_dir, slow_dir = tmp_path / "even", tmp_path / "slow"
    even_log, slow_log = tmp_path / "even.log", tmp_path / "slow.log"
    with two_ranks(
        even_dir, corpus, even_log, f"train.max_steps={STEPS}", *RUN, job_id="51"
    ) as run:
        assert run.wait(timeout=600) == 0, even_log.read_text()[-3000:]
    even = metrics(even_dir)
    judged = [row for row in even if "compute_s_max" in row]
    assert len(even) == STEPS and [row["step"] for row in judged] == list(range(10, 61, EVERY))
    assert not [row for row in even if "straggler_rank" in row], even
    assert "slow: node" not in even_log.read_text()

    with two_ranks(slow_dir, corpus, slow_log, "train.max_steps=1000", *RUN, job_id="52") as run:
        wait_for_step(slow_dir, 3, lambda: run.poll() is None)
        with throttled(rank_processes(run.pid)[1]):
            began = time.monotonic()
            while "slow: node" not in slow_log.read_text():
                assert run.poll() is None, slow_log.read_text()[-3000:]
                assert time.monotonic() - began < NAMED_WITHIN_S, slow_log.read_text()[-3000:]
                time.sleep(0.2)
            named_s = time.monotonic() - began
            rows = metrics(slow_dir)
        for rank in rank_processes(run.pid).values():  # stop as a job's time limit would
            rank.send_signal(signal.SIGUSR1)
        assert run.wait(timeout=120) == 0, slow_log.read_text()[-3000:]
    (blamed,) = [row for row in rows if "straggler_rank" in row]
    record = read_job_end(slow_dir, "0", "52")
    assert record is not None and record["saved"], record
    assert record["slow"] == [
        {
            "node": socket.gethostname(),
            "rank": 1,
            "ratio": round(blamed["straggler_ratio"], 2),
            "step": blamed["step"],
        }
    ], record
    assert blamed["straggler_rank"] == 1 and blamed["straggler_ratio"] >= 1.5, blamed
    assert blamed["straggler_node"] == socket.gethostname()
    line = next(line for line in slow_log.read_text().splitlines() if "slow: node" in line)
    assert f"slow: node {socket.gethostname()}, rank 1, " in line, line
    throttled_steps = [row["step_time_s"] for row in rows if row["step"] >= blamed["step"] - 4]
    slowdown = statistics.median(throttled_steps) / statistics.median(
        row["step_time_s"] for row in even
    )
    print(f"named after {named_s:.1f} s; step time throttled/even: {slowdown:.2f}x")
    assert slowdown > 1.1  # every rank waited for the throttled one


def test_status_names_the_slow_rank_with_its_node(tmp_path):
    """``orchestrator status`` of a chain whose trainer named a rank slow: one line saying so,
    and the same in its --json."""
    chain = "slow-rank-chain"
    named = {
        **train_row(chain, 40, 1, 2.0),
        "straggler_rank": 3,
        "straggler_ratio": 1.84,
        "straggler_node": "n2 GPU 3",
    }
    make_chain(tmp_path, chain, [train_row(chain, 20, 0, 3.0), named])
    shown = run_tool("orchestrator", "status", chain)
    assert shown.returncode == 0, shown.stderr
    line = "slow: node n2 GPU 3, rank 3, 1.8x median (job 1, step 40)"
    assert shown.stdout.count("slow: node") == 1 and line in shown.stdout, shown.stdout
    assert status_json(chain)["slow"] == [line]


def test_the_chain_keeps_the_slow_ranks_its_job_named(tmp_path):
    """The chain's judgement copies the end-of-job record's ``slow`` onto the job's record in
    the manifest, and ``status`` shows it beside the job."""
    run_dir = make_chain(tmp_path, "slow-record-chain", [])
    manifest = Manifest.load(run_dir / MANIFEST_NAME)
    job = manifest.jobs[0]
    named = [{"node": "n2", "rank": 1, "ratio": 1.84, "step": 40}]
    record = job_end_record(
        0, step=40, max_steps=100, signalled=True, signal_name="SIGUSR1", diverged=False
    )
    path = job_end_path(run_dir, str(job.index), str(job.job_id))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**record, "slow": named}))
    _, ending = ChainKeeper(manifest, None).judge_one(job, 0, "COMPLETED", True)
    assert ending.outcome == "stopped" and job.slow == named
    manifest.save()
    shown = status_json("slow-record-chain")["jobs"][0]["reason"]
    assert "slow: node n2, rank 1" in shown, shown
