"""Context parallelism: the decoder's sequence split over the CP group, attention over all of it.

The packed sequence (length S, a multiple of 2 * cp) is cut into 2 * cp equal chunks and rank r
keeps chunks r and 2 * cp - 1 - r: a head chunk and a tail chunk, so every rank does the same
amount of causal attention work (early chunks attend to little, late chunks to much).

Keys and values travel by all-gather: each rank computes K and V of its own positions, gathers
everyone's (an autograd all-gather whose backward reduce-scatters their gradients) and puts
them back in sequence order; its queries then attend to the whole sequence under a causal mask
built from the global positions. Memory per rank: the full K and V (2 x S x kv_width per
layer, while attention runs), and the attention of S / cp queries; traffic per layer: one
all-gather of K and V forward, one reduce-scatter of their gradients backward. A ring would
hold only two chunks of K/V at a time at the same traffic, but costs cp - 1 sequential steps;
at the CP degrees a speech LLM needs (2-8) the all-gather is simpler and no slower.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh


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
    gathered = funcol.all_gather_single_autograd(x.movedim(dim, 0).contiguous(), 0, mesh)
    local = x.shape[dim]
    order = torch.cat([local_positions(local * cp, cp, r, x.device) for r in range(cp)])
    whole = torch.empty_like(gathered).index_copy(0, order, gathered)
    return whole.movedim(0, dim)


def causal_mask(q_positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(queries, seq_len) true where a query may attend: keys at or before its position."""
    keys = torch.arange(seq_len, device=q_positions.device)
    return keys[None, :] <= q_positions[:, None]


def causal_bias(q_positions: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """`causal_mask` as SDPA's additive bias in ``dtype`` (0 where allowed, -inf elsewhere), the
    form attention keeps for its backward, so one tensor can serve every layer."""
    allowed = causal_mask(q_positions, seq_len)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=q_positions.device)
    return bias.masked_fill_(~allowed, float("-inf"))
