"""Context parallelism: the decoder's sequence split over the CP group, attention over all of it.

The packed sequence (length S, a multiple of 2 * cp) is cut into 2 * cp equal chunks and rank r
keeps chunks r and 2 * cp - 1 - r: a head chunk and a tail chunk, so every rank does the same
amount of causal attention work (early chunks attend to little, late chunks to much).

Keys and values travel by all-gather: each rank computes K and V of its own positions, gathers
everyone's (an autograd all-gather whose backward reduce-scatters their gradients) and puts
them back in sequence order. Each of its two query chunks then attends to the keys up to its own
end: the keys before the chunk without a mask, the chunk's own keys causally, the two results
merged by their log-sum-exp, so no mask is ever built. Memory per rank: the full K and V
(2 x S x kv_width per layer, while attention runs) and the attention of S / cp queries; traffic
per layer: one all-gather of K and V forward, one reduce-scatter of their gradients backward. A
ring would hold only two chunks of K/V at a time at the same traffic, but costs cp - 1
sequential steps; at the CP degrees a speech LLM needs (2-8) the all-gather is simpler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from train.compat import all_gather_autograd


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` holds: its head chunk, then its tail chunk."""
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail_start = (2 * cp - 1 - rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, device=device)
    return torch.cat([head, tail])


def shard_sequence(x: torch.Tensor, mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """This rank's chunks of ``x`` along ``dim`` (the backward scatters the gradient back)."""
    positions = local_positions(x.shape[dim], mesh.size(), mesh.get_local_rank(), x.device)
    return x.index_select(dim, positions)


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """Every rank's chunks of ``x`` along ``dim``, in sequence order (differentiable)."""
    cp = mesh.size()
    gathered = all_gather_autograd(x.movedim(dim, 0).contiguous(), mesh)
    local = x.shape[dim]
    order = torch.cat([local_positions(local * cp, cp, r, x.device) for r in range(cp)])
    whole = torch.empty_like(gathered).index_copy(0, order, gathered)
    return whole.movedim(0, dim)


def context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, rank: int
) -> torch.Tensor:
    """Causal attention of rank ``rank``'s queries (B, H, 2c, D: its head chunk, then its tail
    chunk) over the whole sequence's keys and values (B, H_kv, S, D, in sequence order)."""
    chunk = q.shape[2] // 2
    head = prefix_causal_attention(q[:, :, :chunk], k, v, rank * chunk)
    tail = prefix_causal_attention(q[:, :, chunk:], k, v, (2 * cp - 1 - rank) * chunk)
    return torch.cat([head, tail], dim=2)


def prefix_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
) -> torch.Tensor:
    """Causal attention of the queries at positions ``start .. start + L - 1`` over the keys at
    positions ``0 .. start + L - 1``: lower-right aligned, which SDPA's ``is_causal`` is not."""
    end = start + q.shape[2]
    k, v = k[:, :, :end], v[:, :, :end]
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if q.device.type == "cpu":
        return _PrefixCausalAttentionCPU.apply(q, k, v)
    return lower_right_causal_attention(q, k, v)


def lower_right_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last ``L`` positions over all ``S`` keys by SDPA's lower-right
    causal bias, which CUDA runs on its flash or memory-efficient kernel without a mask."""
    from torch.nn.attention.bias import causal_lower_right  # imports dynamo: ~1 s

    bias = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _PrefixCausalAttentionCPU(torch.autograd.Function):
    """`prefix_causal_attention` on CPU's flash kernel, with no mask: the keys before the
    queries' chunk attended in full, the chunk's own keys causally (square, so ``is_causal`` is
    right), the two outputs merged by their log-sum-exp. The backward runs each block's kernel
    backward with the merged output and log-sum-exp, which gives each block's exact share of
    the gradient (as ring attention does)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past = k.shape[2] - q.shape[2]
        out_past, lse_past = _flash_cpu(q, k[:, :, :past], v[:, :, :past], 0.0, False)
        out_own, lse_own = _flash_cpu(q, k[:, :, past:], v[:, :, past:], 0.0, True)
        lse = torch.logaddexp(lse_past, lse_own)
        weight_past = (lse_past - lse).exp().unsqueeze(-1)
        weight_own = (lse_own - lse).exp().unsqueeze(-1)
        out = (out_past * weight_past + out_own * weight_own).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        past = k.shape[2] - q.shape[2]
        grad_out = grad_out.contiguous()
        dq_past, dk_past, dv_past = _flash_cpu_backward(
            grad_out, q, k[:, :, :past], v[:, :, :past], out, lse, 0.0, False
        )
        dq_own, dk_own, dv_own = _flash_cpu_backward(
            grad_out, q, k[:, :, past:], v[:, :, past:], out, lse, 0.0, True
        )
        return (
            dq_past + dq_own,
            torch.cat([dk_past, dk_own], dim=2),
            torch.cat([dv_past, dv_own], dim=2),
        )
