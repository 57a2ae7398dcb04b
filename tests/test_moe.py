"""The experts' grouped GEMM with aligned groups: the padding changes no number."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from train.models.moe import GROUP_ALIGN, aligned_groups, swiglu_experts


def per_expert_reference(x, counts, w1, w3, w2) -> torch.Tensor:
    """Each expert's rows through its own SwiGLU with plain matmuls: no grouped GEMM, no pad."""
    outputs, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        rows = x[start : start + count]
        start += count
        outputs.append((F.silu(rows @ w1[expert]) * (rows @ w3[expert])) @ w2[expert])
    return torch.cat(outputs)


@pytest.mark.parametrize("counts", [[3, 0, 17, 5], [16, 32, 0, 1], [0, 0, 0, 40], [1, 1, 1, 1]])
def test_aligned_groups_give_the_unpadded_outputs_and_gradients(counts):
    counts = torch.tensor(counts)
    g = torch.Generator().manual_seed(0)
    rows = int(counts.sum())
    leaves = [
        torch.randn(rows, 8, generator=g),
        torch.randn(4, 8, 24, generator=g),
        torch.randn(4, 8, 24, generator=g),
        torch.randn(4, 24, 8, generator=g),
    ]
    results = []
    for fn in (swiglu_experts, per_expert_reference):
        inputs = [t.clone().requires_grad_() for t in leaves]
        x, w1, w3, w2 = inputs
        out = fn(x, counts, w1, w3, w2)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach(), *(t.grad for t in inputs)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_group_starts_on_an_aligned_row():
    counts = torch.tensor([3, 0, 17, 5, 16])
    place, ends, capacity = aligned_groups(counts, int(counts.sum()))
    assert capacity % GROUP_ALIGN == 0 and int(ends[-1]) == capacity
    assert all(int(end) % GROUP_ALIGN == 0 for end in ends)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    first_rows = torch.cumsum(counts, 0) - counts
    for expert, count in enumerate(counts.tolist()):
        if count:
            assert int(place[first_rows[expert]]) == int(starts[expert])
    assert len(set(place.tolist())) == len(place)  # no two rows share a padded place
