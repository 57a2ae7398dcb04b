"""The compiled path's graph budget (``compile=true``) over what real runs feed it: varying
batch shapes, batches of one utterance, and validation passes under ``no_grad``, for dense and
MoE blocks. (The end-to-end run, ``python -m train`` on 2 ranks over a real corpus:
``tests/test_gpu_check.py``.)

The crash these tests would have caught: every block shared one dynamo recompile budget (8),
and a B=1 batch after the first validation pass ended the run with ``FailOnRecompileLimitHit``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from train.models.batch import Batch
from train.models.build import build_model
from train.models.compiled import GRAPHS_PER_REGION, graph_counts
from train.models.parallelize import ParallelizeOptions
from train.models.presets import get_preset
from train.parallel.dims import ParallelDims
from train.parallel.mesh import build_meshes


@pytest.fixture
def one_rank_meshes():
    """The meshes of a one-rank gloo world, torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield build_meshes(ParallelDims(world_size=1), "cpu")
    dist.destroy_process_group()


def varied_batches() -> list[tuple[bool, Batch]]:
    """(train?, batch): the shapes a bucketing sampler gives, a batch of one, validation."""
    g = torch.Generator().manual_seed(3)
    shapes = [(True, 3, 160, 20), (True, 2, 230, 31), (False, 4, 120, 12), (True, 1, 300, 25)]
    shapes += [(False, 1, 90, 9), (True, 5, 110, 14)]
    batches = []
    for training, size, frames, tokens in shapes:
        feature_lens = torch.randint(frames // 2, frames + 1, (size,), generator=g)
        token_lens = torch.randint(tokens // 2, tokens + 1, (size,), generator=g)
        batch = Batch(
            torch.randn(size, int(feature_lens.max()), 80, generator=g),
            feature_lens,
            torch.randint(0, 256, (size, int(token_lens.max())), generator=g),
            token_lens,
        )
        batches.append((training, batch))
    return batches


def losses_and_grads(model, batches) -> list[torch.Tensor]:
    seen = []
    for training, batch in batches:
        with torch.set_grad_enabled(training):
            out = model(batch)
            loss = out.nll_sum + out.aux_sum
        seen.append(loss.detach())
        if training:
            loss.backward()
            seen.extend(p.grad.clone() for p in model.parameters())
            model.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize(
    ("preset", "ac"),
    [("tiny", "full"), ("tiny_moe", "selective")],
)
def test_every_region_stays_within_its_graph_budget(preset, ac, one_rank_meshes):
    """Dense and MoE, each activation checkpointing mode: at most 4 graphs per region over
    varied shapes, B=1 and no_grad passes, and the numbers of eager. Dynamo's guards decide the
    graph count whatever compiles the graphs: AOT autograd without inductor here (inductor's
    numbers on real batches: tests/test_gpu_check.py)."""
    torch._dynamo.reset()
    cfg, cpu = get_preset(preset), torch.device("cpu")
    compiled = build_model(
        cfg,
        cpu,
        1234,
        one_rank_meshes,
        ParallelizeOptions(activation_checkpointing=ac, compile=True, compile_backend="aot_eager"),
    )
    eager = build_model(
        cfg, cpu, 1234, one_rank_meshes, ParallelizeOptions(activation_checkpointing=ac)
    )
    batches = varied_batches()
    got, want = losses_and_grads(compiled, batches), losses_and_grads(eager, batches)
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    counts = graph_counts()
    regions = {"encoder_block", "decoder_block"} if not cfg.n_experts else {"encoder_block"}
    if cfg.n_experts:
        regions |= {"moe_mix", "moe_route", "moe_combine", "moe_experts"}
    assert {region for region, n in counts.items() if n} == regions, counts
    assert all(n <= GRAPHS_PER_REGION for n in counts.values()), counts
