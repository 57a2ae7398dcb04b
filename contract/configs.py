"""Where the packaged Hydra configs live, and the names of the entrypoints that read them."""

from __future__ import annotations

PACKAGED_CONFIG_MODULE = "recipes.conf"  # the installed recipes/conf package
PACKAGED_CONFIGS = f"pkg://{PACKAGED_CONFIG_MODULE}"  # as Hydra's config_path takes it
TRAIN_MODULE = "train"  # python -m train
TRAIN_CONFIG = "tiny_fsdp2"  # the config python -m train composes without --config-name
EVALUATE_CONFIG = "evaluate"  # python -m train.evaluate's config
