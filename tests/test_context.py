"""Context parallelism's sequence arithmetic and its mask-free causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from train.models.context import (
    context_attention,
    local_positions,
    lower_right_causal_attention,
    prefix_causal_attention,
)


def causal_mask(q_positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(queries, seq_len) true where a query may attend: keys at or before its position."""
    return torch.arange(seq_len)[None, :] <= q_positions[:, None]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ranks_hold_every_position_once(cp):
    seq_len = 8 * cp
    held = torch.cat([local_positions(seq_len, cp, rank) for rank in range(cp)])
    assert sorted(held.tolist()) == list(range(seq_len))


def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_attention_work_is_balanced(cp):
    """Keys each rank's queries attend to, summed: the same on every rank."""
    seq_len = 16 * cp
    work = [int(causal_mask(local_positions(seq_len, cp, r), seq_len).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work


def attention_and_grads(attend, q, k, v, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    out.backward(grad_out)
    return [out.detach()] + [leaf.grad for leaf in leaves]


def random_heads(queries: int, seq_len: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, queries, 8, generator=generator).to(dtype)
    k, v = (torch.randn(2, 2, seq_len, 8, generator=generator).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=generator).to(dtype)


@pytest.mark.parametrize("start", [0, 8, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_attention_matches_masked_attention(start, dtype):
    """Values and gradients of queries, keys and values, grouped heads included."""
    q, k, v, grad_out = random_heads(8, 32, dtype)
    mask = causal_mask(torch.arange(start, start + 8), 32)
    expected = attention_and_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        q,
        k,
        v,
        grad_out,
    )
    got = attention_and_grads(
        lambda q, k, v: prefix_causal_attention(q, k, v, start), q, k, v, grad_out
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance, msg=name)


def test_the_path_cuda_takes_matches_the_cpu_kernels():
    """SDPA with a lower-right causal bias (materialized on CPU, a flash kernel on CUDA)."""
    q, k, v, grad_out = random_heads(8, 24)
    on_cpu = attention_and_grads(
        lambda q, k, v: prefix_causal_attention(q, k, v, 16), q, k, v, grad_out
    )
    biased = attention_and_grads(lower_right_causal_attention, q, k, v, grad_out)
    for a, b in zip(on_cpu, biased, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_attends_as_the_whole_sequence_would(cp):
    seq_len = 8 * cp
    q, k, v, _ = random_heads(seq_len, seq_len)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for rank in range(cp):
        positions = local_positions(seq_len, cp, rank)
        mine = context_attention(q[:, :, positions], k, v, cp, rank)
        torch.testing.assert_close(mine, whole[:, :, positions], atol=1e-5, rtol=1e-5)
