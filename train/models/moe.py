"""Mixture-of-experts feed-forward: top-k router, grouped experts, and the token dispatcher.

The experts' weights are stacked tensors (E, d, h) and run as one grouped matmul over tokens
sorted by expert (`torch._grouped_mm`, which also runs on CPU in fp32). Parallelism lives in
`TokenDispatcher`: with tensor parallelism each TP rank computes the experts for its own slice of
the (replicated) tokens and the results are summed over TP; with expert parallelism the tokens
travel to the rank owning their expert with `all_to_all_single` (uneven splits) and back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the gradient travels back the same way."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce (sum) backward, as each rank computed part of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward, as every rank receives the same gradient."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@torch.compiler.disable
def _eager_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch.compile's shape check for _grouped_mm accepts only bf16 (the fast CUDA kernel's
    rule), while the eager kernels also run fp32: fp32 grouped matmuls stay eager."""
    return torch._grouped_mm(x, w, offs=offs)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w, offs=offs)
    return _eager_grouped_mm(x, w, offs)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of an expert-parallel weight (the weight itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights; sharded on dim 0 under expert parallelism."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=w.shape[1] ** -0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (M, d) sorted by local expert, ``counts`` (E_local,) tokens per local expert."""
        offs = torch.cumsum(counts, 0).to(torch.int32)
        w1, w3, w2 = _local(self.w1), _local(self.w3), _local(self.w2)
        h = F.silu(_grouped_mm(x, w1, offs)) * _grouped_mm(x, w3, offs)
        return _grouped_mm(h, w2, offs)


class TokenDispatcher:
    """Moves routed tokens to their experts and back; holds the TP and EP groups it talks over.

    `parallelize` sets the groups; with neither set this is a plain local call of the experts.
    """

    def __init__(self) -> None:
        self.tp_group: ProcessGroup | None = None
        self.ep_group: ProcessGroup | None = None

    def token_range(self, n_tokens: int) -> tuple[int, int]:
        """The slice of the TP-replicated tokens this rank routes through the experts."""
        if self.tp_group is None:
            return 0, n_tokens
        size, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        return n_tokens * rank // size, n_tokens * (rank + 1) // size

    def copy_to_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Mark where TP ranks start working on different tokens: their gradients get summed."""
        return x if self.tp_group is None else _CopyToGroup.apply(x, self.tp_group)

    def sum_over_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Add up the TP ranks' partial results; every rank then holds all of them."""
        return x if self.tp_group is None else _SumOverGroup.apply(x, self.tp_group)

    def run(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Apply ``experts`` to ``x`` (sorted by global expert id; ``counts`` per global expert)."""
        if self.ep_group is None:
            return experts(x, counts)
        ep = dist.get_world_size(self.ep_group)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        send = counts.view(ep, -1)
        recv = recv_counts.view(ep, -1)  # [source rank, local expert]
        input_splits = send.sum(1).tolist()
        output_splits = recv.sum(1).tolist()
        received = _AllToAll.apply(x, output_splits, input_splits, self.ep_group)
        # Received rows come grouped by source rank, then expert: regroup them by expert.
        n_local = recv.shape[1]
        local_expert = torch.arange(n_local, device=x.device).repeat(ep)
        row_expert = torch.repeat_interleave(local_expert, recv.flatten())
        order = torch.argsort(row_expert, stable=True)
        y = experts(received[order], recv.sum(0))
        unsorted = torch.empty_like(y).index_copy(0, order, y)
        return _AllToAll.apply(unsorted, input_splits, output_splits, self.ep_group)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with a per-sequence load-balancing loss."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, n_experts)
        self.dispatcher = TokenDispatcher()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (B, S, d), ``mask`` (B, S) true on real positions; returns (output, aux loss)."""
        B, S, d = x.shape
        flat = x.reshape(B * S, d)
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        top_p, top_e = torch.topk(probs, self.top_k, dim=-1)
        weights = (top_p / top_p.sum(-1, keepdim=True)).to(x.dtype)
        aux = self.balance_loss(probs.view(B, S, -1), top_e.view(B, S, -1), mask)

        start, end = self.dispatcher.token_range(B * S)
        experts_flat = top_e[start:end].reshape(-1)
        order = torch.argsort(experts_flat, stable=True)
        counts = torch.bincount(experts_flat, minlength=self.n_experts)
        slot = torch.arange(start * self.top_k, end * self.top_k, device=x.device)[order]
        tokens = self.dispatcher.copy_to_tp(flat)[slot // self.top_k]
        y = self.dispatcher.run(self.experts, tokens, counts)
        per_slot = flat.new_zeros(B * S * self.top_k, d).index_copy(0, slot, y)
        per_slot = self.dispatcher.sum_over_tp(per_slot).view(B * S, self.top_k, d)
        out = (per_slot * weights.unsqueeze(-1)).sum(1)
        return out.view(B, S, d), aux

    def balance_loss(
        self, probs: torch.Tensor, top_e: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Switch-style E * sum_e f_e * P_e per sequence over real positions, mean over sequences.

        Per sequence (not per batch) so that the mean over data-parallel ranks equals the loss of
        the whole global batch.
        """
        m = mask.to(probs.dtype).unsqueeze(-1)  # (B, S, 1)
        n = m.sum(1).clamp(min=1)  # (B, 1)
        picked = F.one_hot(top_e, self.n_experts).sum(2).to(probs.dtype)  # (B, S, E)
        frac_tokens = (picked * m).sum(1) / (n * self.top_k)
        frac_probs = (probs * m).sum(1) / n
        return (self.n_experts * (frac_tokens * frac_probs).sum(-1)).mean()
