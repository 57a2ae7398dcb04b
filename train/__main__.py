"""``python -m train --config-name NAME [key=value ...]``: the shared training entrypoint.

Run under torchrun or srun (one process per rank) or as a single process. Configs are the
installed package data ``recipes.conf``, found from any directory; ``--config-path DIR`` (an
absolute path) puts a folder of the user's own configs first, the packaged ones staying on the
search path after it, and ``--config-dir DIR`` adds a folder after them. A bad config or layout
stops every rank with one ``error:`` line and exit code 2, before any process group exists; a
training that diverges (``train.nonfinite_limit`` consecutive non-finite steps) exits 3 without
saving; a rank that makes no progress for ``train.hang_timeout_s`` (a peer stopped or stuck)
exits 5 without saving (train/loop/watchdog.py); a rank whose collective fails (a peer died, a link
broke) exits 6. A key the schema does not know, or a value of the wrong type, is a bad config
too: Hydra's reason on one ``error:`` line, with the key it probably meant, and exit code 2.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf

from contract.configs import PACKAGED_CONFIGS, TRAIN_CONFIG
from contract.job_end import (
    EXIT_CONFIG,
    EXIT_DIVERGED,
    EXIT_PEER_LOST,
    job_end_record,
    write_job_end,
)
from train.config import ConfigError, TrainConfig, first_line, refuse_uncomposable, register
from train.loop.garbage import pause as pause_collector
from train.loop.stop import StopRequest
from train.parallel.launch_env import apply_launch_env

if TYPE_CHECKING:
    from train.trainer import Trainer

register()


def record_job_end(
    cfg: TrainConfig,
    trainer: Trainer | None,
    stop: StopRequest,
    code: int,
    replace: bool = True,
    error: str | None = None,
) -> None:
    """Tell the chain how this job ended (contract/job_end.py), and the ``error`` line it said:
    the batch script's hook decides from it whether the chain is complete, diverged, or needs a
    replacement job, and the chain's status shows the line."""
    record = job_end_record(
        code,
        step=trainer.step if trainer is not None else 0,
        max_steps=cfg.train.max_steps,
        signalled=trainer is not None and trainer.signalled,
        signal_name=stop.signal_name,
        diverged=code == EXIT_DIVERGED,
        error=error or (trainer.error if trainer is not None else None),
    )
    if trainer is not None and trainer.stragglers.named:
        record["slow"] = trainer.stragglers.named  # the ranks named slow (train.straggler)
    if trainer is not None and trainer.stragglers.leaving and code == 0:
        record["leave_node"] = trainer.stragglers.leaving  # stopped to move off it in place
    write_job_end(cfg.run_dir, record, replace)


def lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` came from the communication backend (a collective or the store): a peer
    rank died or its link broke, which a new job can fix, unlike an error of the training's own.
    gloo raises plain RuntimeErrors that name it; NCCL and the store raise DistErrors."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("gloo" in text or "NCCL" in text)


@hydra.main(version_base=None, config_path=PACKAGED_CONFIGS, config_name=TRAIN_CONFIG)
def main(raw: DictConfig) -> None:
    apply_launch_env()
    cfg: TrainConfig = OmegaConf.to_object(raw)  # type: ignore[assignment]
    # From the first moment: a stop signal that arrives while the model is being built is kept
    # and honoured at the first step boundary, and the time budget counts the whole job.
    stop = StopRequest.for_job(cfg.train.max_time_per_run, os.environ)
    stop.install()
    # The trainer (torch) is imported here, once the stop signal is handled: a sweep's
    # submission (`python -m train -m ...`) runs this module without calling main, torch-free.
    # Python's collector stays quiet until the training loop runs it (train/loop/garbage.py).
    pause_collector()
    import torch.distributed as dist

    from train.parallel.distributed import REFUSAL_GRACE_S, init_distributed
    from train.trainer import Trainer, TrainingDiverged, preflight

    try:
        prepared = preflight(cfg)
    except ConfigError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
            record_job_end(cfg, None, stop, EXIT_CONFIG, error=str(error))
        else:
            # Rank 0 says why. A peer that exited first would have the launcher stop rank 0
            # before its line (seen at 4 ranks on 2 cores: rank 0 still importing); so wait for
            # the launcher's signal, which rank 0's own exit brings.
            stop.wait_for_signal(REFUSAL_GRACE_S)
        sys.exit(EXIT_CONFIG)
    device = init_distributed(cfg.train.hang_timeout_s)
    trainer: Trainer | None = None
    code = 1  # what an exception leaves
    said: str | None = None  # the error line the job ends on
    try:
        trainer = Trainer(cfg, prepared, device, stop)
        code = trainer.run()
    except TrainingDiverged as error:
        if dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        code, said = EXIT_DIVERGED, str(error)
    except Exception as error:
        said_first = first_line(error)
        said = f"{type(error).__name__}: {said_first} (the traceback is in the job's log)"
        if not lost_a_peer(error):
            raise
        traceback.print_exc()
        said = (
            f"rank {dist.get_rank()}: a collective failed ({said_first}): another rank "
            f"died or its connection broke. Exiting with code {EXIT_PEER_LOST}: the next job of "
            "the chain resumes from the last checkpoint; the other ranks' logs say why"
        )
        print(f"error: {said}", file=sys.stderr, flush=True)
        code = EXIT_PEER_LOST
    finally:
        rank = dist.get_rank()
        if rank == 0 or code == EXIT_PEER_LOST:
            record_job_end(cfg, trainer, stop, code, replace=rank == 0, error=said)
        dist.destroy_process_group()
    # Return on success: a SystemExit, even exit(0), keeps submitit from recording the result.
    if code:
        sys.exit(code)


if __name__ == "__main__":
    refuse_uncomposable(main)
