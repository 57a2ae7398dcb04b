"""A fixed synthetic global batch and full parameter gathering, for the in-process and worker
tests that drive the model below the trainer (the trainer's own runs read the real corpus)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from train.models.init import canonical_name
from train.models.salm import PAD_ID

GLOBAL_BATCH = 4
DATA_SEED = 99


def synthetic_batch() -> tuple[torch.Tensor, ...]:
    """The global batch: random features and byte tokens of varied lengths, the same each run."""
    g = torch.Generator().manual_seed(DATA_SEED)
    feature_lens = torch.randint(24, 49, (GLOBAL_BATCH,), generator=g)
    features = torch.randn(GLOBAL_BATCH, int(feature_lens.max()), 80, generator=g)
    token_lens = torch.randint(4, 13, (GLOBAL_BATCH,), generator=g)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, int(token_lens.max())), generator=g)
    positions = torch.arange(tokens.shape[1])[None, :]
    tokens = torch.where(positions < token_lens[:, None], tokens, PAD_ID)
    return features, feature_lens, tokens, token_lens


def full_params(model: torch.nn.Module, pp_group=None) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full shape, from every pipeline stage (a collective: all
    ranks must call it)."""
    params = {
        canonical_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    if pp_group is None:
        return params
    stages: list[dict | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, params, group=pp_group)
    return {name: value for stage in stages for name, value in stage.items()}
