"""The metrics contract: metrics.jsonl per step, one continuous W&B run per chain, no secrets.

Each "job" is a real process, as on the cluster: it constructs a MetricsLogger, logs a few steps
and closes. W&B runs offline in a temporary directory; its .wandb files are read back with wandb's
own reader (``wandb leet inspect --json``), so the checks see what ``wandb sync`` would upload.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from contract.run_dir import METRICS_FILE, RECORD_KEYS
from tests.harness.process import REPO
from tests.harness.wandb_runs import base_env, of_type, wandb_records
from train.metrics import (
    MetricsLogger,
    argv_holds_secret,
    format_progress,
    resolve_wandb_mode,
    scrub_secrets,
)

# One job of a chain: argv = run_dir, run_id ("" for a new run), first step, last step, "wandb" or
# "no-wandb", then overrides it ignores (they stand for Hydra's); the config comes as JSON in
# JOB_CONFIG. Prints the run id.
JOB = """
import json, os, sys
from pathlib import Path
from train.metrics import MetricsLogger

run_dir, run_id, first, last, use_wandb = sys.argv[1:6]
logger = MetricsLogger(
    Path(run_dir), rank=0, run_id=run_id or None, config=json.loads(os.environ["JOB_CONFIG"]),
    total_steps=int(last), wandb_enabled=use_wandb == "wandb",
)
for step in range(int(first), int(last) + 1):
    logger.log(step, {"loss": 1.0 / step, "lr": 0.1, "grad_norm": 0.5,
                      "tokens_per_s": 2500.0, "step_time_s": 0.01})
logger.close({"final_step": int(last)})
print(logger.run_id)
"""

# One rank of a 2-rank gloo job: argv = rendezvous file, rank, run_dir. Prints the run id.
RANK = """
import sys
from pathlib import Path
import torch.distributed as dist
from train.metrics import MetricsLogger

rendezvous, rank, run_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2)
logger = MetricsLogger(
    run_dir, rank=rank, run_id=None, config={}, total_steps=1, wandb_enabled=False
)
logger.log(1, {"loss": 1.0})
logger.close()
dist.destroy_process_group()
print(logger.run_id)
"""

CONFIG = {"lr": 0.1, "layout": "dp2 tp1", "model": {"dim": 64}}


def job_env(tmp: Path, index: int, seed: int, slurm_job_id: str) -> dict[str, str]:
    return {
        **base_env(tmp),
        "ORCH_CHAIN_ID": "chain-abc",
        "ORCH_JOB_INDEX": str(index),
        "ORCH_SEED": str(seed),
        "SLURM_JOB_ID": slurm_job_id,
    }


def job_argv(run_dir: Path, run_id: str, steps: tuple[int, int], use_wandb: bool) -> list[str]:
    flag = "wandb" if use_wandb else "no-wandb"
    return [sys.executable, "-c", JOB, str(run_dir), run_id, str(steps[0]), str(steps[1]), flag]


def run_job(
    env: dict[str, str],
    run_dir: Path,
    run_id: str,
    steps: tuple[int, int],
    *,
    config: dict = CONFIG,
    overrides: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*job_argv(run_dir, run_id, steps, True), *overrides],
        env={**env, "JOB_CONFIG": json.dumps(config)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done


def read_metrics(run_dir: Path) -> list[dict]:
    """The history rows (each job's ``memory`` row, which W&B never sees, left out)."""
    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    return [row for row in rows if not any(key in row for key in RECORD_KEYS)]


@dataclass(frozen=True)
class Chain:
    tmp: Path
    run_dir: Path
    run_id: str
    stderrs: list[str]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    """Two jobs of one chain: job 0 logs steps 1-3, job 1 resumes the same run with steps 4-6.
    Their recipe trains with seeds of its own (111, 222), not the chain's ``ORCH_SEED``: the
    rows name the seed the job trained with."""
    tmp = tmp_path_factory.mktemp("chain")
    run_dir = tmp / "run"
    first = run_job(
        job_env(tmp, 0, 901, "1001"), run_dir, "", (1, 3), config={**CONFIG, "seed": 111}
    )
    run_id = first.stdout.strip()
    second = run_job(
        job_env(tmp, 1, 902, "1002"), run_dir, run_id, (4, 6), config={**CONFIG, "seed": 222}
    )
    assert second.stdout.strip() == run_id
    return Chain(tmp, run_dir, run_id, [first.stderr, second.stderr])


def test_metrics_jsonl_appends_across_jobs(chain: Chain) -> None:
    lines = read_metrics(chain.run_dir)
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    required = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "time"}
    required |= {"job_index", "seed", "slurm_job_id", "chain_id"}
    for line in lines:
        assert required <= line.keys()
    assert [line["job_index"] for line in lines] == [0, 0, 0, 1, 1, 1]
    assert [line["seed"] for line in lines] == [111] * 3 + [222] * 3
    assert [line["slurm_job_id"] for line in lines] == ["1001"] * 3 + ["1002"] * 3
    assert {line["chain_id"] for line in lines} == {"chain-abc"}


def test_no_progress_printed_to_a_pipe(chain: Chain) -> None:
    for stderr in chain.stderrs:
        assert "step 1/" not in stderr and "tok/s" not in stderr, stderr


def test_wandb_offline_chain_is_one_continuous_run(chain: Chain) -> None:
    run_files = sorted((chain.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert run_files, f"no offline run files under {chain.run_dir / 'wandb'}"
    records = [record for path in run_files for record in wandb_records(path, chain.tmp)]

    runs = of_type(records, "run")
    assert len(runs) == len(run_files)
    assert {run["run_id"] for run in runs} == {chain.run_id}
    assert {run["run_group"] for run in runs} == {"chain-abc"}
    assert {run["project"] for run in runs} == {"speechlm"}
    assert all(run.get("resume") for run in runs)

    # A clean command line keeps wandb's metadata (it is left out only when secrets are in argv).
    assert any("args" in env for env in of_type(records, "environment"))

    history = of_type(records, "history")
    assert sorted(row["step"]["num"] for row in history) == [1, 2, 3, 4, 5, 6]
    for row in history:
        step, item = row["step"]["num"], row["item"]
        assert item["job_index"] == (0 if step <= 3 else 1)
        assert item["seed"] == (111 if step <= 3 else 222)
        assert item["loss"] == pytest.approx(1.0 / step)

    config: dict = {}
    for update in of_type(records, "config") + [run["config"] for run in runs]:
        config.update(update.get("update", {}))
    assert config["jobs/0/seed"] == 111 and config["jobs/1/seed"] == 222
    assert config["jobs/0/slurm_job_id"] == "1001" and config["jobs/1/slurm_job_id"] == "1002"
    assert config["layout"] == "dp2 tp1" and config["model"] == {"dim": 64}


def test_no_secret_lands_in_any_file(tmp_path: Path) -> None:
    env = {
        **job_env(tmp_path, 0, 5, "77"),
        "WANDB_API_KEY": "secret-value-123",
        "WANDB_MODE": "offline",
    }
    config = {
        **CONFIG,
        "hf_token": "hf-value-456",
        "storage": {"dbPassword": "pw-value-789"},
        "endpoint": "https://user:secret-value-123@example.org",
        "tokens_per_batch": 8,
    }
    run_dir = tmp_path / "run"
    run_job(env, run_dir, "", (1, 2), config=config, overrides=("+hf_token=hf-value-456",))

    run_files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 3, files
    for secret in (b"secret-value-123", b"hf-value-456", b"pw-value-789"):
        leaks = [str(p) for p in files if secret in p.read_bytes()]
        assert not leaks, f"{secret!r} written to {leaks}"
    sent = of_type(wandb_records(run_files[0], tmp_path), "run")[0]["config"]["update"]
    assert "hf_token" not in sent and "endpoint" not in sent
    assert sent["storage"] == {} and sent["tokens_per_batch"] == 8


def test_wandb_failure_leaves_metrics_going(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb").write_text("a file where wandb wants its directory")
    done = run_job(job_env(tmp_path, 0, 5, "77"), run_dir, "", (1, 3))
    warnings = [line for line in done.stderr.splitlines() if "W&B is off" in line]
    assert len(warnings) == 1, done.stderr
    assert [line["step"] for line in read_metrics(run_dir)] == [1, 2, 3]


def test_progress_line_on_a_terminal(tmp_path: Path) -> None:
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        job_argv(tmp_path / "run", "", (1, 3), use_wandb=False),
        env={**base_env(tmp_path), "JOB_CONFIG": json.dumps(CONFIG)},
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=follower,
    )
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert process.wait(timeout=120) == 0
    text = output.decode()
    assert text.count("\rstep ") == 3, text
    assert "step 3/3 (100%) | loss 0.3333 | 2.5k tok/s | ETA 0m00s" in text
    assert text.endswith("\n")


def test_other_ranks_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, rank=1, run_id=None, config=CONFIG, total_steps=3)
    logger.log(1, {"loss": 1.0})
    logger.close({"final_step": 1})
    assert not run_dir.exists()
    assert capsys.readouterr() == ("", "")
    assert len(logger.run_id) == 8


def test_ranks_agree_on_a_new_run_id(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(tmp_path / "rendezvous"), str(rank), str(run_dir)],
            env=base_env(tmp_path),
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    ids = [process.communicate(timeout=120)[0].strip() for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0]
    assert ids[0] == ids[1] and len(ids[0]) == 8
    assert [p.name for p in run_dir.iterdir()] == [METRICS_FILE]
    assert [line["step"] for line in read_metrics(run_dir)] == [1]


def test_given_run_id_is_kept(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, rank=1, run_id="abc12345", config={}, total_steps=1)
    assert logger.run_id == "abc12345"


@pytest.mark.parametrize(
    ("explicit", "environ", "mode"),
    [
        ("disabled", {"WANDB_MODE": "online", "WANDB_API_KEY": "k"}, "disabled"),
        (None, {"WANDB_MODE": "offline", "WANDB_API_KEY": "k"}, "offline"),
        (None, {"WANDB_API_KEY": "k"}, "online"),
        (None, {}, "offline"),
    ],
)
def test_wandb_mode(explicit: str | None, environ: dict[str, str], mode: str) -> None:
    assert resolve_wandb_mode(explicit, environ) == mode


def test_secrets_are_scrubbed_from_what_is_logged() -> None:
    nested = {"a": [{"github_token": "x"}, "see k-123"], "b": ("k-123", 1), "c": 2}
    assert scrub_secrets(nested, "k-123") == {"a": [{}], "b": [1], "c": 2}
    assert argv_holds_secret(["lr=0.1", "data.hf_token=x"], None)
    assert argv_holds_secret(["--api-key", "x"], None)
    assert argv_holds_secret(["url=https://k-123@host"], "k-123")
    assert not argv_holds_secret(["lr=0.1", "data.max_tokens=8", "/data/tokens"], "k-123")


def test_progress_format() -> None:
    line = format_progress(50, 200, {"loss": 2.5, "tokens_per_s": 1_234_567.0}, 3725.0)
    assert line == "step 50/200 (25%) | loss 2.5000 | 1.2M tok/s | ETA 1h02m"
    assert format_progress(1, 200, {}, None) == "step 1/200 (0%) | ETA --"
