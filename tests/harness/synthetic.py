"""A fixed synthetic global batch and full parameter gathering, for the in-process and worker
tests that drive the model below the trainer (the trainer's own runs read the real corpus)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from train.loop.step import WholeModelRunner
from train.models.batch import Batch
from train.models.build import build_model, build_pipeline
from train.models.init import canonical_name
from train.models.parallelize import ParallelizeOptions
from train.models.pipeline import PipelineRunner, merged_view
from train.models.shape import PAD_ID, SALMConfig
from train.parallel.dims import ParallelDims
from train.parallel.mesh import Meshes
from train.parallel.pipeline_plan import pipeline_plan

GLOBAL_BATCH = 4
DATA_SEED = 99


def synthetic_batch() -> Batch:
    """The global batch: random features and byte tokens of varied lengths, the same each run."""
    g = torch.Generator().manual_seed(DATA_SEED)
    feature_lens = torch.randint(24, 49, (GLOBAL_BATCH,), generator=g)
    features = torch.randn(GLOBAL_BATCH, int(feature_lens.max()), 80, generator=g)
    token_lens = torch.randint(4, 13, (GLOBAL_BATCH,), generator=g)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, int(token_lens.max())), generator=g)
    positions = torch.arange(tokens.shape[1])[None, :]
    tokens = torch.where(positions < token_lens[:, None], tokens, PAD_ID)
    return Batch(features, feature_lens, tokens, token_lens)


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


def built(
    cfg: SALMConfig, dims: ParallelDims, meshes: Meshes | None
) -> tuple[WholeModelRunner | PipelineRunner, torch.nn.Module, dist.ProcessGroup | None]:
    """``cfg``'s model at ``dims`` as the trainer builds it (initial seed 99, fp32; 1F1B
    pipeline stages when pp > 1), the runner that steps it, and the pipeline's group."""
    cpu = torch.device("cpu")
    if not dims.pp_enabled:
        model = build_model(cfg, cpu, 99, meshes)
        return WholeModelRunner(model, cpu), model, None
    plan = pipeline_plan(cfg, dims.pp, "1f1b", 0, 0, [])
    parts = build_pipeline(cfg, cpu, 99, meshes, ParallelizeOptions(), plan)
    pp_group = meshes.pp.get_group()
    runner = PipelineRunner(parts, plan, pp_group, cpu, torch.float32, dims.tp)
    return runner, merged_view(parts), pp_group


def save_and_end(results: dict, out: str) -> None:
    """A worker's last act: rank 0 (or the one plain process) saves ``results`` to ``out``,
    then the process group ends."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, out)
    if dist.is_initialized():
        dist.destroy_process_group()
