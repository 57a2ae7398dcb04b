"""A chain's run dir: the names in it, its complete checkpoints, and whether its disk has room.

    RUN_DIR/
      checkpoints/step_<N>/        a complete checkpoint: its COMPLETE marker and state.json
      checkpoint_location          the s3:// prefix they are under instead (checkpoint.location)
      checkpoints/.tmp-step_<N>-*  a save in progress, or one a crash tore (the trainer's own)
      metrics.jsonl                one JSON row per logged step, appended across jobs
      eval/step_<N>/               what ``python -m train.evaluate`` wrote for that checkpoint
      job_ends/<index>-<id>.json   how each job's training ended (contract.job_end)
      job_starts/<index>-<id>.json what each job ran (its config, world, GPU): the planner's
      logs/<job name>-<id>.out     each job's log
      avoid_nodes/<id>             nodes the job's next launches stay off, one a line (a slow
                                   node swapped for a spare of the allocation: the chain hook)

The trainer writes it, the orchestrator (status, plot, the chain hook) and the evaluation read it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"
# Where checkpoints in object storage are (checkpoint.location): their s3:// prefix, one line.
CHECKPOINT_LOCATION_FILE = "checkpoint_location"
MARKER = "COMPLETE"  # written last into a checkpoint: one without it is not complete
STATE_FILE = "state.json"  # a checkpoint's step, data position and layout
METRICS_FILE = "metrics.jsonl"
# metrics.jsonl rows that are records of a job, not its history: each job's state memory (the
# planner's measured bytes). W&B never sees them.
RECORD_KEYS = ("memory",)
# metrics.jsonl keys with a name after them: the validation loss of each of several validation
# sets (``val_loss/<set>``, beside the pooled ``val_loss``) and the cuts drawn from each
# training source (``cuts/<source>``, summed over ranks since the previous row).
VAL_LOSS_PREFIX = "val_loss/"
CUTS_PREFIX = "cuts/"
EVAL_DIR = "eval"
JOB_ENDS_DIR = "job_ends"
# What each job ran, written at its first step (the resolved config, the world, ranks per node,
# the GPU), so that `orchestrator plan --calibrate RUN_DIR` can price the layout its logged
# steps came from: job_starts/<index>-<id>.json ("local" for the id outside a job).
JOB_STARTS_DIR = "job_starts"
LOGS_DIR = "logs"
AVOID_NODES_DIR = "avoid_nodes"
CODE_SNAPSHOT_DIR = "code"  # the work tree as it was at submission, which every job runs
CODE_DIFF = "code.diff"  # its uncommitted changes against the recorded commit
STEP_DIR = re.compile(r"step_(\d+)")
TMP_DIR = re.compile(r"\.tmp-step_(\d+)-.+")


def step_name(step: int) -> str:
    """The directory name of step ``step``'s checkpoint (and of its evaluation)."""
    return f"step_{step}"


def tmp_step_name(step: int, unique: str) -> str:
    """The directory a save of step ``step`` is written into before its rename: ``TMP_DIR``."""
    return f".tmp-{step_name(step)}-{unique}"


def job_start_path(run_dir: Path | str, job_index: str, job_id: str | None) -> Path:
    return Path(run_dir) / JOB_STARTS_DIR / f"{job_index}-{job_id or 'local'}.json"


def avoid_nodes_path(run_dir: Path | str, job_id: str) -> Path:
    """The nodes job ``job_id``'s next launches of the training stay off (``AVOID_NODES_DIR``)."""
    return Path(run_dir) / AVOID_NODES_DIR / job_id


def log_pattern(run_dir: Path, job_name: str) -> Path:
    """Where a job's log goes; ``%j`` stands for its job id (sbatch's own notation)."""
    return Path(run_dir) / LOGS_DIR / f"{job_name}-%j.out"


def scan_checkpoints(checkpoints: Path) -> tuple[dict[int, Path], list[tuple[int, Path]]]:
    """Complete checkpoints by step, and the torn entries (step dirs without the marker, and
    saves in progress or torn), both under a ``checkpoints`` directory."""
    complete: dict[int, Path] = {}
    torn: list[tuple[int, Path]] = []
    if not checkpoints.is_dir():
        return complete, torn
    for entry in sorted(checkpoints.iterdir()):
        step_match = STEP_DIR.fullmatch(entry.name)
        tmp_match = TMP_DIR.fullmatch(entry.name)
        if step_match and (entry / MARKER).is_file():
            complete[int(step_match.group(1))] = entry
        elif step_match or tmp_match:
            torn.append((int((step_match or tmp_match).group(1)), entry))
    return complete, torn


def complete_checkpoints(run_dir: Path) -> dict[int, Path]:
    """The run dir's complete checkpoints by step (oldest first)."""
    return scan_checkpoints(Path(run_dir) / CHECKPOINTS_DIR)[0]


def not_writable(directory: Path) -> bool:
    """Whether nothing can be written under ``directory`` (an existing one): a read-only mount
    or no write permission."""
    return bool(os.statvfs(directory).f_flag & os.ST_RDONLY) or not os.access(directory, os.W_OK)


def room_shortfall(checkpoints: Path) -> tuple[int, int, Path] | None:
    """``(free bytes, bytes needed, newest checkpoint)`` when the disk under ``checkpoints`` has
    less room than the newest complete checkpoint took, so the next save would not fit; else
    None (also when there is no checkpoint yet to measure)."""
    complete, _ = scan_checkpoints(checkpoints)
    if not complete:
        return None
    newest = complete[max(complete)]
    needed = sum(path.stat().st_size for path in newest.rglob("*") if path.is_file())
    free = shutil.disk_usage(checkpoints).free
    return None if free >= needed else (free, needed, newest)
