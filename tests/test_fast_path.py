"""The pieces of the GPU fast path that run anywhere: FLOPs and peaks for MFU, mixed-precision
numerics, the device-side skip of non-finite steps, foreach clipping, and initialization by
parameter name. (Compiled blocks and every layout's equivalence: test_trainer_equivalence.py.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.flop_counter import FlopCounterMode

from tests.harness.synthetic import synthetic_batch
from train.flops import (
    PEAK_FLOPS_ENV,
    llm_weights_per_position,
    loss_recompute_flops,
    peak_flops,
    step_flops,
)
from train.models.batch import Batch
from train.models.build import build_model
from train.models.init import canonical_name, init_weights, name_seed
from train.models.loss import loss_for_backward, loss_targets
from train.models.parallelize import (
    ParallelizeOptions,
    compute_autocast,
    mixed_precision_policies,
)
from train.models.presets import LLAMA_3_2_1B_DECODER, get_preset
from train.models.salm import SALM
from train.models.shape import audio_positions
from train.parallel.distributed import clip_grad_norm

CPU = torch.device("cpu")


@pytest.fixture
def one_rank_group():
    """A one-rank gloo world for FSDP on CPU, torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_by_gpu_name(name, expected):
    assert peak_flops(name, {}) == expected


def test_peak_flops_override():
    assert peak_flops("NVIDIA H100 80GB HBM3", {PEAK_FLOPS_ENV: "7.5e14"}) == 7.5e14
    assert peak_flops("anything", {PEAK_FLOPS_ENV: "1e12"}) == 1e12


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_step_flops_match_pytorchs_flop_counter(preset):
    """Forward + backward of one unpadded example, counted by torch's FlopCounterMode. Ours
    counts the first conv's input gradient (never computed) and causal attention in full (the
    PaLM convention), so it may only be a few percent higher; with the head's logits computed
    again by the loss's backward."""
    cfg = get_preset(preset)
    model = build_model(cfg, CPU, 1)
    model.seq_multiple = 1  # no padding: the counter sees exactly the real positions
    feature_lens, token_lens = torch.tensor([203]), torch.tensor([37])
    features, tokens = torch.randn(1, 203, 80), torch.randint(0, 256, (1, 37))
    with FlopCounterMode(display=False) as counter:
        out = model(Batch(features, feature_lens, tokens, token_lens))
        (out.nll_sum + out.aux_sum).backward()
    positions = audio_positions(cfg, feature_lens) + token_lens
    counted = step_flops(cfg, feature_lens, token_lens) + loss_recompute_flops(cfg, positions)
    ratio = float(counted) / counter.get_total_flops()
    assert 1.0 <= ratio < 1.07, ratio


def test_step_flops_use_real_lengths_and_add_up_over_examples():
    cfg = get_preset("small")
    feature_lens, token_lens = torch.tensor([100, 300]), torch.tensor([20, 40])
    both = step_flops(cfg, feature_lens, token_lens)
    one = step_flops(cfg, feature_lens[:1], token_lens[:1])
    other = step_flops(cfg, feature_lens[1:], token_lens[1:])
    assert both == pytest.approx(one + other)
    # Attention grows with the square of each sequence: one long example costs more than two
    # examples of half its length.
    long = step_flops(cfg, torch.tensor([400]), torch.tensor([40]))
    halves = step_flops(cfg, torch.tensor([200, 200]), torch.tensor([20, 20]))
    assert long > halves


def test_moe_flops_count_the_active_experts_only():
    dense, moe = get_preset("tiny"), get_preset("tiny_moe")
    per_block_attention = llm_weights_per_position(dense) - dense.n_layers * 3 * 64 * 128
    expected_moe = per_block_attention + moe.n_layers * (64 * 4 + 2 * 3 * 64 * 64)
    assert llm_weights_per_position(moe) == expected_moe


def test_loss_targets_from_lengths_equal_the_models_count():
    batch = synthetic_batch()
    out = build_model(get_preset("tiny"), CPU, 1)(batch)
    assert int(loss_targets(batch.token_lens)) == int(out.num_tokens)


def test_ddp_on_cuda_autocasts_to_bf16_and_fsdp_does_not():
    ddp = ParallelizeOptions(strategy="ddp")
    cuda_ddp = compute_autocast(ddp, "cuda")
    assert isinstance(cuda_ddp, torch.autocast)
    assert (cuda_ddp.device, cuda_ddp.fast_dtype) == ("cuda", torch.bfloat16)
    fsdp = ParallelizeOptions(strategy="fsdp2")
    assert isinstance(compute_autocast(fsdp, "cuda"), contextlib.nullcontext)
    assert isinstance(compute_autocast(ddp, "cpu"), contextlib.nullcontext)
    off = ParallelizeOptions(strategy="ddp", mixed_precision=False)
    assert isinstance(compute_autocast(off, "cuda"), contextlib.nullcontext)


def test_the_model_computes_in_bf16_under_autocast():
    """What ddp's autocast does on CUDA, on the CPU: matmuls in bf16, the loss in fp32 (the
    head's matmuls: tests/test_head_loss.py)."""
    model = build_model(get_preset("tiny"), CPU, 1)
    dtypes = []
    model.llm.layers["0"].attn.wq.register_forward_hook(
        lambda _m, _i, out: dtypes.append(out.dtype)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(synthetic_batch())
    assert dtypes == [torch.bfloat16]
    assert out.nll_sum.dtype == torch.float32


def test_fsdp_bf16_keeps_rope_tables_fp32(one_rank_group):
    """The root casts the inputs to bf16; blocks get bf16 activations but fp32 cos/sin."""
    model = SALM(get_preset("tiny"))
    root, inner = mixed_precision_policies(bf16=True)
    assert root.cast_forward_inputs and not inner.cast_forward_inputs
    for block in [*model.encoder.layers, *model.llm.layers.values()]:
        fully_shard(block, mesh=one_rank_group, mp_policy=inner)
    fully_shard(model, mesh=one_rank_group, mp_policy=root)
    seen = []
    for block in (model.encoder.layers[0], model.llm.layers["0"]):
        block.attn.register_forward_pre_hook(
            lambda _m, args: seen.append((args[0].dtype, args[1].dtype, args[2].dtype))
        )
    model(synthetic_batch())
    assert seen == [(torch.bfloat16, torch.float32, torch.float32)] * 2


def test_fsdp_finds_the_loss_in_the_models_output_to_gather_the_root_for_backward(
    one_rank_group,
):
    """FSDP2 hooks its pre-backward re-gather on the output tensors it finds, up to torch 2.11
    with ``tree_flatten``: a plain dataclass output hid them, the root (head included) stayed
    resharded in backward, and every bf16 step on a GPU failed with ``setStorage: sizes [259,
    2048] ... storage of size 0``. Here the root is resharded after forward (the bf16 head
    weight's storage freed), and backward must gather it again."""
    from torch.utils._pytree import tree_flatten

    from train.models import parallelize
    from train.parallel.dims import ParallelDims
    from train.parallel.mesh import build_meshes

    options = ParallelizeOptions(mixed_precision=True)
    meshes = build_meshes(ParallelDims(world_size=1), "cpu")
    with pytest.MonkeyPatch.context() as patch:  # FSDP2's bf16 policy, as on a GPU
        patch.setattr(parallelize, "fsdp_mixed_precision", lambda _meshes, _options: True)
        model = build_model(get_preset("tiny"), CPU, 1, meshes, options)
    out = model(synthetic_batch())
    leaves, _ = tree_flatten(out)
    assert any(leaf is out.nll_sum for leaf in leaves) and out.nll_sum.requires_grad
    loss_for_backward(out, out.num_tokens.float(), torch.tensor(4.0), 1).backward()
    assert all(p.grad is not None for p in model.llm.lm_head.parameters())


def test_nonfinite_gradient_skips_the_step_on_the_device():
    model = build_model(get_preset("tiny"), CPU, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    out = model(synthetic_batch())
    out.nll_sum.backward()
    next(model.parameters()).grad.fill_(float("nan"))
    norm = clip_grad_norm(model, 1.0)
    assert torch.isnan(norm)
    optimizer.found_inf = (~torch.isfinite(norm)).float()
    optimizer.step()
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert all(int(state["step"]) == 0 for state in optimizer.state.values())


def test_clipping_matches_torch_reference():
    models = [build_model(get_preset("tiny"), CPU, 1) for _ in range(2)]
    for model in models:
        model(synthetic_batch()).nll_sum.backward()
    ours = clip_grad_norm(models[0], 0.5)
    reference = torch.nn.utils.clip_grad_norm_(models[1].parameters(), 0.5)
    torch.testing.assert_close(ours, reference)
    for mine, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_initialization_by_name_is_independent_of_how_the_model_was_built():
    cfg = get_preset("tiny_moe")
    on_meta = build_model(cfg, CPU, 7)
    direct = SALM(cfg)
    init_weights(direct, 7)
    for (name, a), (_, b) in zip(
        on_meta.named_parameters(), direct.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
        assert torch.isfinite(a).all(), name
    other_seed = build_model(cfg, CPU, 8)
    assert not torch.equal(on_meta.llm.embed.weight, other_seed.llm.embed.weight)
    # Norms start at one; every other weight differs from its neighbours' (own name, own seed).
    assert torch.equal(on_meta.llm.norm.weight, torch.ones(cfg.d_model))
    assert not torch.equal(
        on_meta.llm.layers["0"].attn.wq.weight, on_meta.llm.layers["1"].attn.wq.weight
    )


# Each preset's width and vocabulary, tied and untied, and Llama 3.2 1B's (tied, 128,256 tokens).
# One block each: the final norm gives the head inputs of RMS 1 whatever the depth.
INITIAL_LOSS_SHAPES = {
    **{
        f"{name}{'_tied' if tied else ''}": dataclasses.replace(
            get_preset(name), n_layers=1, enc_layers=1, tie_embeddings=tied
        )
        for name in ("tiny", "tiny_moe", "small", "llm_1b")
        for tied in (False, True)
    },
    "llama3.2_1b": dataclasses.replace(
        get_preset("llm_1b"), **{**LLAMA_3_2_1B_DECODER, "n_layers": 1}, enc_layers=1
    ),
}


@pytest.mark.parametrize("name", INITIAL_LOSS_SHAPES)
def test_a_model_from_scratch_starts_near_ln_vocab(name):
    """A from-scratch model's first loss is within 10% of ln(vocab), tied head or not (a tied
    head drawn as the embedding, N(0, 1), started Llama 3.2 1B's shape near 1,900)."""
    cfg = INITIAL_LOSS_SHAPES[name]
    model = build_model(cfg, CPU, 7)
    batch = synthetic_batch()
    with torch.no_grad():
        out = model(batch)
    loss = float(out.nll_sum / out.num_tokens)
    assert loss == pytest.approx(math.log(cfg.vocab_size), rel=0.1), loss


def test_canonical_names_drop_wrappers():
    assert canonical_name("llm.layers.0._checkpoint_wrapped_module.attn.wq.weight") == (
        "llm.layers.0.attn.wq.weight"
    )
    assert canonical_name("encoder._orig_mod.conv1.weight") == "encoder.conv1.weight"
    assert name_seed(1, "a.weight") != name_seed(1, "b.weight") != name_seed(2, "a.weight")
