"""``python -m train --config-name NAME [key=value ...]``: the shared training entrypoint.

Run under torchrun or srun (one process per rank) or as a single process. Configs are the
installed package data ``recipes.conf``, found from any directory; ``--config-path DIR`` (an
absolute path) puts a folder of the user's own configs first, the packaged ones staying on the
search path after it, and ``--config-dir DIR`` adds a folder after them. A bad config or layout
stops every rank with one ``error:`` line and exit code 2, before any process group exists; a
training that diverges (``train.nonfinite_limit`` consecutive non-finite steps) exits 3 without
saving; a rank that makes no progress for ``train.hang_timeout_s`` (a peer stopped or stuck)
exits 5 without saving (train/watchdog.py); a key the schema does not know, or a value of the
wrong type, is Hydra's own error (exit 1).
"""

from __future__ import annotations

import os
import sys

import hydra
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.orch_chain_launcher.searchpath import PACKAGED_CONFIGS
from train.config import TrainConfig, register
from train.launch_env import apply_launch_env
from train.stop import StopRequest
from train.trainer import (
    EXIT_DIVERGED,
    ConfigError,
    Trainer,
    TrainingDiverged,
    init_distributed,
    preflight,
)

register()


@hydra.main(version_base=None, config_path=PACKAGED_CONFIGS, config_name="tiny_fsdp2")
def main(raw: DictConfig) -> None:
    apply_launch_env()
    cfg: TrainConfig = OmegaConf.to_object(raw)  # type: ignore[assignment]
    # From the first moment: a stop signal that arrives while the model is being built is kept
    # and honoured at the first step boundary, and the time budget counts the whole job.
    stop = StopRequest(cfg.train.max_time_per_run)
    stop.install()
    try:
        dims, plan = preflight(cfg)
    except ConfigError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    device = init_distributed(cfg.train.hang_timeout_s)
    try:
        code = Trainer(cfg, dims, plan, device, stop).run()
    except TrainingDiverged as error:
        if dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        code = EXIT_DIVERGED
    finally:
        dist.destroy_process_group()
    # Return on success: a SystemExit, even exit(0), keeps submitit from recording the result.
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
