"""Results written here in the documented formats (metrics.jsonl rows, eval/step_<N>/summary.json)
in registered chains, and the status that reads them back."""

from __future__ import annotations

import json
import time
from pathlib import Path

from contract.run_dir import METRICS_FILE
from orchestrator.manifest import JobRecord, Manifest, register_chain
from tests.harness.process import run_tool


def train_row(chain_id: str, step: int, job_index: int, loss: float) -> dict:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "tokens_per_s": 100.0 + step,
        "job_index": job_index,
        "seed": 10 + job_index,
        "chain_id": chain_id,
        "slurm_job_id": str(500 + job_index),
        "time": 1.0 * step,
    }


def val_row(chain_id: str, step: int, job_index: int, val_loss: float) -> dict:
    """A validation row as the trainer writes it: the job context, no ``loss``."""
    return {
        "step": step,
        "val_loss": val_loss,
        "val_tokens": 4096,
        "val_split": "dev",
        "job_index": job_index,
        "seed": 10 + job_index,
        "chain_id": chain_id,
        "slurm_job_id": str(500 + job_index),
        "time": 1.0 * step,
    }


def write_eval(run_dir: Path, step: int, wer: float, text: str | None = None) -> None:
    folder = run_dir / "eval" / f"step_{step}"
    folder.mkdir(parents=True)
    summary = {
        "step": step,
        "split": "dev",
        "num_utterances": 64,
        "wer": wer,
        "cer": wer / 2,
        "utterances_per_s": 12.5,
        "layout": "dp_shard=2",
    }
    (folder / "summary.json").write_text(text if text is not None else json.dumps(summary))
    (folder / "hypotheses.jsonl").write_text("")


def make_chain(root: Path, chain_id: str, rows: list[dict]) -> Path:
    """A registered two-job chain whose run dir holds ``rows``; the jobs are ids no backend
    knows (status reads them UNKNOWN), which is all the results need."""
    run_dir = root / chain_id
    run_dir.mkdir(parents=True)
    manifest = Manifest(
        chain_id=chain_id,
        recipe=str(run_dir / "r.sub"),
        recipe_sha256="0" * 64,
        script=str(run_dir / "r.sub"),
        run_dir=str(run_dir),
        backend="local",
        dependency_kind="afterany",
        num_jobs=2,
        args=[],
        base_seed=None,
        git_sha=None,
        git_dirty=None,
        created=time.time(),
        status="submitted",
        jobs=[JobRecord(index, 10 + index, f"no-such-job-{chain_id}-{index}") for index in (0, 1)],
    )
    manifest.save()
    register_chain(manifest)
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def status_json(name: str) -> dict:
    done = run_tool("orchestrator", "status", name, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
