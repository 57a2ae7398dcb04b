"""One way to build the model every job trains: on the meta device, parallelized, then
materialized shard by shard and initialized by parameter name (see ``train.models.init``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from train.models.init import canonical_name, init_weights
from train.models.parallelize import ParallelizeOptions, parallelize
from train.models.pipeline import PipelinePart, pipeline_parts
from train.models.salm import SALM, build_encoder
from train.models.shape import SALMConfig
from train.parallel.mesh import Meshes
from train.parallel.pipeline_plan import PipelinePlan


def build_model(
    cfg: SALMConfig,
    device: torch.device,
    init_seed: int,
    meshes: Meshes | None = None,
    options: ParallelizeOptions | None = None,
) -> SALM:
    """The initialized model on ``device``; with ``meshes``, parallelized by ``options``.

    Each rank only ever allocates its own shards, and the weights equal a single process's for
    the same ``init_seed`` whatever the layout.
    """
    with torch.device("meta"):
        model = SALM(cfg)
    if meshes is not None:
        parallelize(model, meshes, options or ParallelizeOptions())
    model.to_empty(device=device)
    model.llm.tie_head()
    init_weights(model, init_seed)
    return model


def build_pipeline(
    cfg: SALMConfig,
    device: torch.device,
    init_seed: int,
    meshes: Meshes,
    options: ParallelizeOptions,
    plan: PipelinePlan,
) -> list[PipelinePart]:
    """This rank's pipeline stages, each built, parallelized and initialized like a whole model
    (so each holds the single process's values of its parameters)."""
    with torch.device("meta"):
        model = SALM(cfg)
    parts = pipeline_parts(model, plan, meshes.pp.get_local_rank())
    for part in parts:
        parallelize(part, meshes, options)
        part.to_empty(device=device)
        init_weights(part, init_seed)
    return parts


def encoder_replica(model: SALM, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A plain copy of ``model``'s encoder (which FSDP may shard) holding its full weights, on
    ``device``, in eval mode and ``dtype``, for ``train.models.encoder_cache``. Collective when
    sharded: every rank gathers every tensor, in one order."""
    weights = {
        canonical_name(name): value.full_tensor() if isinstance(value, DTensor) else value
        for name, value in model.encoder.state_dict().items()
    }
    with torch.device("meta"):
        replica = build_encoder(model.cfg)
    replica.to_empty(device=device)
    replica.load_state_dict(weights, strict=True)
    return replica.to(dtype).eval().requires_grad_(False)


def freeze_parameters(model: nn.Module, frozen: set[str]) -> list[nn.Parameter]:
    """Stop the gradients of the parameters named in ``frozen`` (whole-model names, from
    ``train.parallel.layout.frozen_of``) before the first forward, so FSDP never reduces them;
    returns the parameters that still train, for the optimizer (which then keeps no state for the
    others)."""
    trainable = []
    for name, param in model.named_parameters():
        trains = canonical_name(name) not in frozen
        param.requires_grad_(trains)  # peft's layers leave their own marks: these decide
        if trains:
            trainable.append(param)
    return trainable
