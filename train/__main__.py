"""``python -m train --config-name NAME [key=value ...]``: the shared training entrypoint.

Run under torchrun or srun (one process per rank) or as a single process. Configs live in
recipes/conf/ (``--config-path`` picks another folder). A bad config or layout stops every rank
with one ``error:`` line and exit code 2, before any process group exists.
"""

from __future__ import annotations

import os
import sys

import hydra
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from train.config import TrainConfig, register
from train.trainer import ConfigError, Trainer, init_distributed, preflight

register()


@hydra.main(version_base=None, config_path="../recipes/conf", config_name="tiny_fsdp2")
def main(raw: DictConfig) -> None:
    cfg: TrainConfig = OmegaConf.to_object(raw)  # type: ignore[assignment]
    try:
        dims = preflight(cfg)
    except ConfigError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    device = init_distributed()
    try:
        code = Trainer(cfg, dims, device).run()
    finally:
        dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
