"""Per-step metrics of a training job: ``metrics.jsonl``, one W&B run per chain, a progress line.

Every job of a chain shares one run directory, so every job appends to one ``metrics.jsonl`` there
(flushed per line: a job killed by SLURM loses nothing it logged). The W&B run id is kept in the
checkpoint and handed back to the next job, which resumes the same run (``resume="allow"``) and logs
with ``step=``, so the curve is continuous across jobs; ``job_index`` and ``seed`` are logged per
step so a dashboard can mark job boundaries, and ``in_job_restart`` on the steps of a training
launched again inside its job. Only rank 0 writes; other ranks' calls return at once.

A dashboard must never kill training: when W&B fails, one warning is printed and ``metrics.jsonl``
goes on. Secrets never leave the environment: keys that look secret are dropped from the config
sent to W&B, the run's metadata (which records the command line) is left out when the command line
carries a secret, and the API key is only ever read by wandb itself from ``WANDB_API_KEY``.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from contract import job_env
from contract.credentials import looks_secret
from contract.run_dir import METRICS_FILE

_RUN_ID_CHARS = string.ascii_lowercase + string.digits


def resolve_wandb_mode(explicit: str | None, environ: Mapping[str, str]) -> str:
    """The explicit mode, else WANDB_MODE, else online when an API key is set, else offline."""
    if explicit:
        return explicit
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


def scrub_secrets(value: Any, api_key: str | None) -> Any:
    """``value`` less secret-looking keys and strings holding the API key, at any depth."""
    if isinstance(value, Mapping):
        return {
            key: scrub_secrets(item, api_key)
            for key, item in value.items()
            if not looks_secret(str(key)) and not _holds_key(item, api_key)
        }
    if isinstance(value, list | tuple):
        return [scrub_secrets(item, api_key) for item in value if not _holds_key(item, api_key)]
    return value


def argv_holds_secret(argv: list[str], api_key: str | None) -> bool:
    """Whether a command line carries a secret-looking override (``hf_token=...``, ``--api-key``)
    or the API key: wandb records the arguments with the run's metadata."""
    return any(looks_secret(arg.split("=", 1)[0]) or _holds_key(arg, api_key) for arg in argv)


def _holds_key(value: Any, api_key: str | None) -> bool:
    return bool(api_key) and isinstance(value, str) and api_key in value


def job_context(environ: Mapping[str, str], config: Mapping[str, Any]) -> dict[str, Any]:
    """This job's place in its chain, from the orchestrator's environment contract.

    A run outside a chain is job 0. The seed is the config's ``seed``, the one the job trains
    with, whatever ``ORCH_SEED`` says (a recipe may pass another).
    """
    context = {
        "job_index": int(environ.get(job_env.JOB_INDEX, "0")),
        "seed": config.get("seed"),
        "slurm_job_id": job_env.job_id(environ),
        "chain_id": environ.get(job_env.CHAIN_ID),
    }
    if environ.get(job_env.IN_JOB_RESTART):  # launched again inside its job (the chain hook)
        context["in_job_restart"] = int(environ[job_env.IN_JOB_RESTART])
    return context


def new_run_id() -> str:
    """A fresh W&B-style run id: 8 random base-36 characters."""
    return "".join(secrets.choice(_RUN_ID_CHARS) for _ in range(8))


def agreed_run_id(run_id: str | None) -> str:
    """``run_id``, or a new one drawn on rank 0 and broadcast, so every rank checkpoints the same.

    Collective when torch.distributed is initialized and no id is given (all ranks then call it).
    """
    if run_id is not None:
        return run_id
    drawn = [new_run_id()]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(drawn, src=0)
    return drawn[0]


def format_progress(step: int, total: int, metrics: Mapping[str, Any], eta_s: float | None) -> str:
    """One short status line: step/total, loss, tokens/s, ETA."""
    parts = [f"step {step}/{total} ({100 * step / max(total, 1):.0f}%)"]
    if isinstance(metrics.get("loss"), int | float):
        parts.append(f"loss {metrics['loss']:.4f}")
    if isinstance(metrics.get("tokens_per_s"), int | float):
        parts.append(f"{_human(metrics['tokens_per_s'])} tok/s")
    parts.append(f"ETA {_duration(eta_s)}" if eta_s is not None else "ETA --")
    return " | ".join(parts)


def _human(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _json_value(value: Any) -> Any:
    """Strict JSON has no NaN or infinity: a non-finite float is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Writes rank 0's per-step metrics to ``run_dir/metrics.jsonl``, W&B and a terminal.

    Every rank constructs one (a new run id is agreed on collectively); only rank 0 does work.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        run_id: str | None,
        config: dict,
        total_steps: int,
        wandb_enabled: bool = True,
        wandb_project: str = "speechlm",
        wandb_mode: str | None = None,
    ) -> None:
        self._run_id = agreed_run_id(run_id)
        self._active = rank == 0
        self._total_steps = total_steps
        self._run: Any = None
        self._file = None
        self._tty = False
        self._progress_shown = False
        self._first: tuple[float, int] | None = None
        if not self._active:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._context = job_context(os.environ, config)
        self._file = (run_dir / METRICS_FILE).open("a", encoding="utf-8")
        self._tty = sys.stderr.isatty()
        mode = resolve_wandb_mode(wandb_mode, os.environ)
        if wandb_enabled and mode != "disabled":
            self._start_wandb(run_dir, config, wandb_project, mode)

    @property
    def run_id(self) -> str:
        """The W&B run id (new if none was given): the trainer keeps it in its checkpoints."""
        return self._run_id

    def _start_wandb(self, run_dir: Path, config: dict, project: str, mode: str) -> None:
        try:
            import wandb

            api_key = os.environ.get("WANDB_API_KEY")
            index = self._context["job_index"]
            self._run = wandb.init(
                id=self._run_id,
                resume="allow",
                project=project,
                group=os.environ.get(job_env.SWEEP_ID) or os.environ.get(job_env.CHAIN_ID) or None,
                job_type="train",
                dir=str(run_dir),
                mode=mode,
                config=scrub_secrets(config, api_key),
                settings=wandb.Settings(
                    console="off",
                    quiet=True,
                    x_disable_meta=argv_holds_secret(sys.argv[1:], api_key),
                ),
            )
            self._run.config.update(
                {
                    f"jobs/{index}/seed": self._context["seed"],
                    f"jobs/{index}/slurm_job_id": self._context["slurm_job_id"],
                },
                allow_val_change=True,
            )
        except Exception as error:
            self._wandb_failed(error)

    def _wandb_failed(self, error: Exception) -> None:
        print(
            f"[metrics] W&B is off for the rest of this job ({type(error).__name__}: {error}); "
            f"{METRICS_FILE} goes on",
            file=sys.stderr,
            flush=True,
        )
        self._run = None

    def log(self, step: int, metrics: dict[str, float | int | str | None]) -> None:
        """Record one step: a metrics.jsonl line, a W&B history row, the progress line."""
        record = self.write(step, metrics)
        if record is None:
            return
        if self._run is not None:
            numbers = {
                k: v
                for k, v in record.items()
                if isinstance(v, int | float) and k not in ("step", "time")
            }
            try:
                self._run.log(numbers, step=step)
            except Exception as error:
                self._wandb_failed(error)
        if self._tty:
            self._show_progress(step, metrics)

    def write(self, step: int, fields: dict[str, Any]) -> dict[str, Any] | None:
        """One metrics.jsonl line (with the job's context and the time), and nothing else: what
        log() sends on, and records that are not history (the ``memory`` row)."""
        if not self._active or self._file is None:
            return None
        record: dict[str, Any] = {"step": step, **fields}
        for key, value in self._context.items():
            record.setdefault(key, value)
        record["time"] = round(time.time(), 3)
        self._file.write(json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        return record

    def _show_progress(self, step: int, metrics: Mapping[str, Any]) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = (now, step)
        started, first_step = self._first
        eta = None
        if step > first_step:
            eta = (self._total_steps - step) * (now - started) / (step - first_step)
        line = format_progress(step, self._total_steps, metrics, eta)
        sys.stderr.write(f"\r{line}\x1b[K")
        sys.stderr.flush()
        self._progress_shown = True

    def close(self, summary: dict | None = None) -> None:
        """End the progress line, write ``summary`` to the W&B run and finish it."""
        if not self._active or self._file is None:
            return
        if self._progress_shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
        self._file.close()
        self._file = None
        if self._run is not None:
            try:
                if summary:
                    self._run.summary.update(
                        scrub_secrets(summary, os.environ.get("WANDB_API_KEY"))
                    )
                self._run.finish()
            except Exception as error:
                self._wandb_failed(error)
            self._run = None
