"""Checkpoints in object storage (``checkpoint.location=s3://bucket/prefix``), in a real
S3-compatible store (``rclone serve s3`` on loopback) with the credentials in the environment
only, as a cloud cluster without a big shared file system keeps them.

Two ranks of the tiny SALM: two jobs of two steps resume bitwise where one job of four steps on
the run dir's own disk ends, with synchronous and with asynchronous saves; pruning leaves
exactly ``checkpoint.keep`` complete saves in the bucket; a chain of ``auto_launch --backend
local`` is judged from the bucket (each job's newest complete step); a save torn before its
marker (every object written) and one torn before its shard (the data object never written: an
unfinished multipart upload is no object) are never loaded, and the next job resumes from the
previous complete one; a location that cannot be used is one line, exit 2, nothing queued; and
the secret is in no file a run writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from contract.run_dir import CHECKPOINT_LOCATION_FILE, CHECKPOINTS_DIR
from tests.harness.chains import tiny_training_chain
from tests.harness.models import final_model
from tests.harness.object_store import SECRET_KEY, ObjectStore, free_port, object_store
from tests.harness.process import REPO, kill_tree, run_tool
from tests.harness.training import train, train_overrides, train_together, wait_until
from train.checkpoint.location import completed, prefix_for
from train.checkpoint.pauses_for_tests import PAUSE_ENV, PAUSED_SUFFIX, WRITE_PAUSE_PREFIX
from train.data.storage import listing

BUCKET = "checkpoints"
LOCATION = f"s3://{BUCKET}/runs"
COMMON = ("seed=3", "train.max_steps=4", "checkpoint.interval=1", "checkpoint.keep=2")
COMMON += ("wandb.enabled=false", "eval.interval=0", "train.log_every=1")
IN_BUCKET = (f"checkpoint.location={LOCATION}",)


@dataclass(frozen=True)
class Runs:
    store: ObjectStore
    on_disk: Path  # one job of four steps, RUN_DIR/checkpoints
    sync: Path  # two jobs of two, in the bucket
    background: Path  # the same with checkpoint.async_save


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObjectStore]:
    with object_store(tmp_path_factory.mktemp("s3") / "store", (BUCKET,)) as served:
        yield served


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, corpus: Path, store: ObjectStore) -> Runs:
    work = tmp_path_factory.mktemp("runs")
    on_disk, sync, background = work / "on_disk", work / "sync", work / "background"
    half = ("train.max_steps_per_run=2",)
    async_save = ("checkpoint.async_save=true",)
    env = store.env()
    first = {
        on_disk: COMMON,
        sync: (*COMMON, *IN_BUCKET, *half),
        background: (*COMMON, *IN_BUCKET, *half, *async_save),
    }
    train_together(first, corpus, 2, env=env)
    second = {sync: (*COMMON, *IN_BUCKET), background: (*COMMON, *IN_BUCKET, *async_save)}
    train_together(second, corpus, 2, env=env)
    return Runs(store, on_disk, sync, background)


@pytest.fixture
def in_store_env(store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    """This process's environment holding the store's credentials (the tools read it)."""
    for key, value in store.env().items():
        monkeypatch.setenv(key, value)
    return store


def bucket_steps(run_dir: Path) -> dict[str, set[str]]:
    """The objects of the run's prefix in the bucket, by step prefix."""
    objects: dict[str, set[str]] = {}
    for key in listing(prefix_for(LOCATION, run_dir)):
        head, _, name = key.partition("/")
        objects.setdefault(head, set()).add(name)
    return objects


def test_two_jobs_in_the_bucket_end_bitwise_where_one_on_disk_does(runs, in_store_env) -> None:
    """Sync and async saves: the final weights equal the one job's on the run dir's disk; the
    bucket holds the run's prefix and the run dir no checkpoints of its own."""
    want = final_model(runs.on_disk)
    for run_dir in (runs.sync, runs.background):
        assert (run_dir / CHECKPOINT_LOCATION_FILE).read_text().strip() == prefix_for(
            LOCATION, run_dir
        )
        assert not (run_dir / CHECKPOINTS_DIR).exists()
        got = final_model(run_dir)
        assert got.keys() == want.keys()
        for name, weight in want.items():
            assert torch.equal(got[name], weight), f"{run_dir.name}: {name}"


def test_pruning_leaves_exactly_keep_complete_saves_in_the_bucket(runs, in_store_env) -> None:
    for run_dir in (runs.sync, runs.background):
        objects = bucket_steps(run_dir)
        assert sorted(objects) == ["step_3", "step_4"], run_dir.name
        assert all("COMPLETE" in names and "state.json" in names for names in objects.values())
        assert sorted(completed(run_dir)) == [3, 4]


def test_no_file_a_run_writes_holds_the_secret(runs) -> None:
    written = [p for run in (runs.sync, runs.background) for p in run.rglob("*") if p.is_file()]
    assert written
    assert [p for p in written if SECRET_KEY.encode() in p.read_bytes()] == []
    stored = [p for p in runs.store.root.rglob("*") if p.is_file()]
    assert stored and [p for p in stored if SECRET_KEY.encode() in p.read_bytes()] == []


def test_a_chain_is_judged_from_the_bucket(store, corpus, tmp_path) -> None:
    """``auto_launch --backend local`` of two jobs of two steps: each job's newest complete
    step, as its hook found it in the bucket, is in the manifest and the chain completes."""
    run_dir = tmp_path / "run"
    summary = tiny_training_chain(
        run_dir,
        corpus,
        2,
        0,
        *COMMON,
        *IN_BUCKET,
        "train.max_steps_per_run=2",
        env=store.env(),
        launch_args=("--backend", "local", "--no-plan-check"),
    )
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete", summary
    assert [job["checkpoint_step"] for job in manifest["jobs"]] == [2, 4]


def train_until_paused(run_dir: Path, corpus: Path, env: dict, arm: Path, *overrides: str) -> None:
    """The trainer on 2 ranks until the checkpoint writer's test hook pauses at ``arm``; then
    SIGKILL to the launcher and its ranks: the save is torn at that moment."""
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "train"]
    args += ["--config-name", "tiny_fsdp2", *train_overrides(run_dir, corpus, *overrides)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    with open(run_dir.parent / f"{run_dir.name}.torn.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, *args], cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            paused = arm.with_name(arm.name + PAUSED_SUFFIX)
            wait_until(lambda: paused.exists() or process.poll() is not None, 240, "the pause")
            assert process.poll() is None, (run_dir.parent / f"{run_dir.name}.torn.log").read_text()
        finally:
            kill_tree(process)


@pytest.mark.parametrize(
    ("arm", "async_save", "shard_written"),
    [("step_2", "false", True), (f"{WRITE_PAUSE_PREFIX}step_2", "true", False)],
    ids=["before-the-marker", "before-the-shard"],
)
def test_a_torn_save_in_the_bucket_is_never_loaded(
    store, in_store_env, corpus, tmp_path, arm, async_save, shard_written
) -> None:
    """Killed while step_2's save is held before its marker (every object written), or, in
    the background, before DCP writes its shard (the RNG objects written, no data): step_2
    has objects but no marker and is never taken; the next job removes it and resumes from
    step_1, to the end."""
    run_dir, pauses = tmp_path / "run", tmp_path / "pauses"
    pauses.mkdir()
    (pauses / arm).write_text("600")
    settings = (*COMMON, *IN_BUCKET, f"checkpoint.async_save={async_save}")
    env = {**store.env(), PAUSE_ENV: str(pauses)}
    train_until_paused(run_dir, corpus, env, pauses / arm, *settings)
    torn = bucket_steps(run_dir)
    assert "COMPLETE" in torn["step_1"] and "COMPLETE" not in torn["step_2"], torn
    assert {"rng/rank_00000.pt", "rng/rank_00001.pt"} <= torn["step_2"], torn
    data = {name for name in torn["step_2"] if name.endswith(".distcp") or name == ".metadata"}
    assert bool(data) == shard_written, torn
    assert sorted(completed(run_dir)) == [1]

    resumed = train(run_dir, corpus, *settings, nproc=2, env=store.env())
    said = resumed.stdout + resumed.stderr
    assert f"resumed from {prefix_for(LOCATION, run_dir)}/step_1 at step 1" in said, said[-2000:]
    assert sorted(completed(run_dir)) == [3, 4]


@pytest.mark.parametrize(
    ("location", "env", "said"),
    [
        ("s3://nobucket/runs", {}, "bucket 'nobucket' does not exist"),
        (LOCATION, {"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, "access refused"),
        (LOCATION, {"AWS_ENDPOINT_URL": "closed"}, "the endpoint cannot be reached"),
        ("gs://bucket/runs", {}, "give an s3://bucket/prefix"),
    ],
    ids=["no-bucket", "wrong-secret", "no-endpoint", "not-s3"],
)
def test_a_location_that_cannot_be_used_queues_nothing(
    store, corpus, tmp_path, location, env, said
) -> None:
    if env.get("AWS_ENDPOINT_URL") == "closed":
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    run_dir = tmp_path / "run"
    done = run_tool(
        "auto_launch", "-n2", "--backend", "local", "--run-dir", str(run_dir),
        "recipes/train_tiny_fsdp2.yaml", "--", f"data.corpus={corpus}",
        f"checkpoint.location={location}",
        cwd=REPO, env=store.env(**env),
    )  # fmt: skip
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert said in errors[0] and "checkpoint.location" in errors[0], errors[0]
    assert SECRET_KEY not in done.stderr + done.stdout
    assert not (run_dir / "manifest.json").exists()
