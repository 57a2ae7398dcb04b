"""The encoder's segments packed into one sequence (train/models/frame_packing.py): the plan's
layout, attention kept within each segment, and the own encoder's output and gradients equal to
the padded encoder's at every length a stride-2 convolution treats differently at its edges,
eager and compiled. Whisper's packed blocks on real batches: tests/test_conversations.py and
tests/test_hf_encoder.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.harness.hf_tiny import save_tiny_encoder
from train.config import ModelConfig
from train.models.build import build_model
from train.models.compiled import graph_counts
from train.models.frame_packing import (
    MIN_FEATURE_FRAMES,
    encoder_plan,
    frame_packing,
    packed_attention,
    padding_share,
)
from train.models.layers import length_mask
from train.models.parallelize import apply_compile
from train.models.presets import get_preset
from train.models.shape import encoder_frames, subsampled_lens
from train.parallel.layout import model_of

CPU = torch.device("cpu")
TINY = get_preset("tiny")


def features_of(lens: list[int], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Random features of ``lens`` frames, zero-padded to the longest, and their lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lens)
    features = torch.randn(len(lens), max(lens), TINY.n_mels, generator=g)
    return features * length_mask(lengths, max(lens))[..., None], lengths


def test_each_segment_starts_aligned_after_zeros_at_every_level():
    """Segments start at multiples of the subsampling with at least that many zero frames
    before the next; each level's mask covers exactly each segment's subsampled frames; the
    slots number the encoder frames row by row, -1 on padding."""
    lens = torch.tensor([37, 1, 4, 101])
    plan = frame_packing(TINY, lens)
    stride = TINY.enc_subsampling
    starts, at = [], 0
    for n in lens.tolist():
        starts.append(at)
        at += -(-n // stride) * stride + stride
    assert plan.level_masks[0].shape[0] == at
    placed = [s + i for s, n in zip(starts, lens.tolist(), strict=True) for i in range(n)]
    assert plan.feature_dst.tolist() == placed
    for level, mask in enumerate(plan.level_masks):
        real = subsampled_lens(lens, level).tolist()
        want = torch.zeros(at // 2**level, dtype=torch.bool)
        for start, n in zip(starts, real, strict=True):
            want[start // 2**level : start // 2**level + n] = True
        assert torch.equal(mask, want)
    frames = encoder_frames(TINY, lens)
    assert plan.slots.shape == (4, int(frames.max()))
    assert plan.slots[plan.slots >= 0].tolist() == list(range(int(frames.sum())))
    assert ((plan.slots >= 0).sum(1) == frames).all()
    assert plan.frame_pos.tolist() == [i for n in frames.tolist() for i in range(n)]


def test_a_batch_without_audio_still_runs_the_encoder_on_zeros():
    plan = encoder_plan(
        TINY, build_model(TINY, CPU, 0).encoder, torch.zeros(3, 2, dtype=torch.long)
    )
    assert plan.rows.tolist() == [0]
    assert len(plan.packing.feature_dst) == 0  # no feature of the batch is read
    assert int(plan.packing.level_masks[0].sum()) == MIN_FEATURE_FRAMES
    assert plan.packing.slots.shape == (
        1,
        int(encoder_frames(TINY, torch.tensor(MIN_FEATURE_FRAMES))),
    )


def test_only_encoders_that_pack_get_a_packing(tmp_path):
    """The own encoder and Whisper's pack; Parakeet's convolution module and relative positions
    run per utterance, so it runs padded (its empty segments still skipped)."""
    lens = torch.tensor([[30, 0], [12, 7]])
    for encoder, packs in (("whisper", True), ("parakeet", False)):
        directory = save_tiny_encoder(encoder, tmp_path / encoder)
        model = build_model(model_of(ModelConfig(pretrained_encoder=str(directory))), CPU, 0)
        plan = encoder_plan(model.cfg, model.encoder, lens)
        assert plan.rows.tolist() == [0, 2, 3]
        assert (plan.packing is not None) == packs


def test_packed_attention_keeps_each_segment_to_itself():
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 1, 9])
    plan = frame_packing(get_preset("tiny"), lens * 4)
    q, k, v = (torch.randn(int(lens.sum()), 2, 8, generator=g) for _ in range(3))
    got = packed_attention(q, k, v, plan.slots)
    want, start = [], 0
    for n in lens.tolist():
        heads = [t[start : start + n].transpose(0, 1) for t in (q, k, v)]
        want.append(F.scaled_dot_product_attention(*heads).transpose(0, 1))
        start += n
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-6)


def assert_same_gradients(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Equal within fp32 rounding of sums taken in another order: a convolution's weight
    gradient sums over every frame, packed in one row or padded in many."""
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max()) <= 1e-5 * max(float(w.abs().max()), 1e-3)


def encoder_step(encoder, features, lens, plan):
    """The encoder's output on real frames and the gradients of a loss on them."""
    encoder.zero_grad()
    out, out_lens = encoder(features, lens, plan)
    out = out * length_mask(out_lens, out.shape[1])[..., None]
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = [p.grad.clone() for p in encoder.parameters()]
    return out, out_lens, grads


@pytest.mark.parametrize("lens", [[1, 2, 3, 4, 5, 6, 7, 8, 9], [64, 17, 150, 3]])
def test_the_packed_own_encoder_equals_the_padded_one(lens):
    """Every length modulo 4 (a segment's last frames read the zeros after it), one frame, and
    segments of very different lengths: the same frames and gradients within fp32 rounding."""
    encoder = build_model(TINY, CPU, 5).encoder.train()
    features, lengths = features_of(lens)
    plan = frame_packing(TINY, lengths)
    padded = encoder_step(encoder, features, lengths, None)
    packed = encoder_step(encoder, features, lengths, plan)
    assert torch.equal(padded[1], packed[1])
    torch.testing.assert_close(packed[0], padded[0][:, : packed[0].shape[1]], rtol=1e-5, atol=1e-6)
    assert_same_gradients(packed[2], padded[2])
    assert padding_share(TINY, lengths) > 0.3  # what the blocks no longer run


def test_the_compiled_packed_encoder_equals_eager_on_few_graphs():
    """Compiled with ``fullgraph=True``, packed batches of other sizes and lengths (one segment
    among them) give eager's frames, on at most two graphs (one segment, several)."""
    torch._dynamo.reset()
    eager = build_model(TINY, CPU, 5).encoder
    compiled = build_model(TINY, CPU, 5).encoder
    apply_compile(compiled.layers, "encoder_block", compiled.block_dims, "aot_eager")
    for lens in ([40, 13, 77], [9, 100], [55], [31, 8, 64, 12]):
        features, lengths = features_of(lens, seed=len(lens))
        plan = frame_packing(TINY, lengths)
        want = encoder_step(eager, features, lengths, plan)
        got = encoder_step(compiled, features, lengths, plan)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        assert_same_gradients(got[2], want[2])
    assert graph_counts()["encoder_block"] <= 2
