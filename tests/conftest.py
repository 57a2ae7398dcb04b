"""Session-wide test setup: a private ORCH_HOME and a real SLURM cluster on loopback.

The cluster is started with the project's own command (``orchestrator cluster up``), so every
session also checks that command the way a user runs it. Without SLURM installed the fixture fails
with the command's own message (run ``make setup-slurm``): a SLURM test that silently skips would
hide that nothing was checked.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cluster.queries import cancel_all_jobs
from orchestrator.cluster.record import CONF_NAME
from tests import ledger
from tests.harness.cluster import (
    SESSION_ENV,
    LoopbackCluster,
    cluster_cli,
    down_clusters_of_dead_sessions,
    open_to_every_user,
)
from tests.harness.corpora import LIBRISPEECH_UTTERANCES, TINY_CORPUS
from tests.harness.disk import tmpfs
from tests.harness.process import REPO, checkout_paths, run_python, run_script
from tests.harness.wandb_runs import WANDB_MODE

# Two shared cores: every torch process the tests start stays on one thread.
os.environ["OMP_NUM_THREADS"] = "1"
# Every process the tests start, SLURM's jobs included, runs W&B disabled unless its test asks for
# it (tests/harness/wandb_runs.py: WANDB_OFFLINE, base_env).
os.environ["WANDB_MODE"] = WANDB_MODE
# The checkout's paths as the session starts (the controller's, under pytest-xdist).
CHECKOUT_BEFORE = pytest.StashKey[set[str]]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first (tests/ledger.py), so the two workers of ``make test`` finish
    together instead of one running a long module alone at the end."""
    seconds = ledger.recorded()
    items.sort(key=lambda item: ledger.module_order(item.path.stem, seconds))


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller, or a run without workers
        session.config.stash[CHECKOUT_BEFORE] = checkout_paths()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Tests write only into their temporary folders: anything new in the checkout after the
    session fails it, named (a fresh clone's run once left data/mix/features behind)."""
    before = session.config.stash.get(CHECKOUT_BEFORE, None)
    if before is None:
        return
    written = sorted(checkout_paths() - before)
    if written:
        shown = "\n  ".join(written[:20])
        print(
            f"\nerror: the tests wrote {len(written)} path(s) into the checkout instead of "
            f"their temporary folders:\n  {shown}",
            file=sys.stderr,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every run ends with each module's seconds (setup, call and teardown, summed over the
    workers), longest first and against the ledger: a CI log says where the minutes went."""
    reports = [
        report
        for category in terminalreporter.stats.values()
        for report in category
        if isinstance(report, pytest.TestReport)
    ]
    if reports:
        terminalreporter.write_sep("-", "seconds per test module (summed over workers)")
        terminalreporter.write_line(ledger.module_table(ledger.report_seconds(reports)))


@pytest.fixture(scope="session", autouse=True)
def orch_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Chains, indexes and default cluster dirs of the session land in a temporary ORCH_HOME."""
    home = tmp_path_factory.mktemp("orch_home")
    previous = os.environ.get("ORCH_HOME")
    os.environ["ORCH_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("ORCH_HOME", None)
    else:
        os.environ["ORCH_HOME"] = previous


@pytest.fixture(scope="session")
def slurm_cluster(
    tmp_path_factory: pytest.TempPathFactory, orch_home: Path
) -> Iterator[LoopbackCluster]:
    """A 2-node cluster with accounting (slurmdbd, MariaDB) for the whole session; SLURM_CONF
    points every SLURM command at it."""
    down_clusters_of_dead_sessions()
    os.environ[SESSION_ENV] = str(os.getpid())
    directory = tmp_path_factory.mktemp("slurm")
    open_to_every_user(directory)
    started = cluster_cli(
        "up", "--nodes", "2", "--cpus-per-node", "4", "--accounting", "--dir", str(directory)
    )
    if started.returncode != 0:
        pytest.fail(
            f"the loopback SLURM cluster did not start (exit {started.returncode}):\n"
            f"{started.stderr}{started.stdout}",
            pytrace=False,
        )
    conf = directory / CONF_NAME
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        yield LoopbackCluster(directory, conf, {**os.environ, "SLURM_CONF": str(conf)})
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        stopped = cluster_cli("down", "--dir", str(directory))
        assert stopped.returncode == 0, f"cluster down failed:\n{stopped.stderr}{stopped.stdout}"


@pytest.fixture
def empty_queue(slurm_cluster: LoopbackCluster) -> LoopbackCluster:
    """The session cluster with jobs left by earlier tests cancelled, so the queue starts empty."""
    cancel_all_jobs(slurm_cluster.conf)
    assert slurm_cluster.queue_job_ids() == []
    return slurm_cluster


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real speech corpus (espeak-ng voices, lhotse manifests, fbank), made once."""
    out = tmp_path_factory.mktemp("corpus") / "corpus"
    made = run_script(REPO / "recipes/make_corpus.py", "--out", str(out), "--num", "64",
                      "--jobs", "2", timeout=300)  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def librispeech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny corpus in LibriSpeech's own layout with lhotse's manifests (made by lhotse's own
    `lhotse prepare librispeech`) in manifests/, made once per session."""
    out = tmp_path_factory.mktemp("librispeech") / "corpus"
    command = ["-m", "recipes.make_librispeech", "--out", str(out)]
    command += ["--utterances", str(LIBRISPEECH_UTTERANCES), "--jobs", "2"]
    result = run_python(command, 1, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A real 2 MiB file system (tmpfs) to fill up."""
    with tmpfs(tmp_path / "disk", "2m") as disk:
        yield disk


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16-utterance corpus in 4-utterance Shar shards, made once per session."""
    out = tmp_path_factory.getbasetemp() / "tiny_corpus"
    result = run_script(REPO / "recipes/make_corpus.py", "--out", str(out), *TINY_CORPUS)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo world, as a job of one process has, torn down after the test."""
    import torch.distributed as dist  # only the training tests pay for torch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
