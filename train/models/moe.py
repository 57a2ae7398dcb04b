"""Mixture-of-experts feed-forward: top-k router, grouped experts, and the token dispatcher.

The experts' weights are stacked tensors (E, d, h) and run as one grouped matmul over tokens
sorted by expert. Routing keeps static shapes (counts by ``scatter_add``, not ``bincount``), so
it compiles with ``fullgraph=True``.

Under tensor + sequence parallelism the MoE works on this rank's sequence shard: no all-gather
of the sequence and no all-reduce of a (tokens x top_k x d) tensor. Each TP rank routes and runs
its own tokens through whole experts; the router's weight gradient is summed over TP by DTensor
(the router is sequence-parallel, see ``parallelize``), the experts' by FSDP over the efsdp
ranks, and only the balance loss's small per-sequence sums cross the TP group.

Under expert parallelism tokens travel to the rank owning their expert with
``all_to_all_single_autograd`` (a functional collective, uneven splits) and back. The split
sizes must be known on the host, so EP pays one device-to-host copy of 2 x ep counts per MoE
layer and forward (``host_split_sizes``): the only host read of a training step.

The experts run as one grouped GEMM over rows sorted by expert, each expert's group padded to
``GROUP_ALIGN`` rows (``aligned_groups``) as the CUDA kernel wants in bf16.

Compilation (``parallelize.apply_compile``) draws one graph boundary, around the dispatcher:
``route``, ``combine`` and the experts' ``compute`` each compile with ``fullgraph=True``, while
the dispatcher runs eagerly, because FSDP's hooks on the experts (their own mesh) cannot be
traced inside a checkpointed block and EP's split sizes are host values.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

# Rows per expert group in the grouped GEMM: its bf16 (and fp8) CUDA kernels want every group to
# start on an aligned row (torchtitan pads groups to 8 or 16 rows); 16 serves both.
GROUP_ALIGN = 16


@torch.library.custom_op("salm::grouped_mm_fp32", mutates_args=())
def _grouped_mm_fp32(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp32 grouped matmul as an opaque op: torch.compile's shape check for ``_grouped_mm``
    accepts only bf16 (the fast CUDA kernel's rule) while the eager kernels also run fp32, so
    fp32 runs (CPU tests, fp32 training) keep the eager kernel without a graph break."""
    return torch._grouped_mm(x, w, offs=offs)


@_grouped_mm_fp32.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[-1]))


@torch.library.custom_op("salm::grouped_mm_fp32_backward", mutates_args=())
def _grouped_mm_fp32_backward(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs)
    grad_w = torch._grouped_mm(x.t(), grad, offs=offs)
    return grad_x, grad_w


@_grouped_mm_fp32_backward.register_fake
def _(grad, x, w, offs) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    grad_x, grad_w = _grouped_mm_fp32_backward(grad.contiguous(), x, w, offs)
    return grad_x, grad_w, None


_grouped_mm_fp32.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row groups of ``x`` (M, d) times ``w`` (E, d, h); group e ends at row ``offs[e]``."""
    if x.dtype == torch.float32:
        return _grouped_mm_fp32(x, w, offs)
    return torch._grouped_mm(x, w, offs=offs)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def aligned_groups(
    counts: torch.Tensor, rows: int, align: int = GROUP_ALIGN
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row groups laid out so that every group starts at a multiple of ``align`` rows.

    ``counts`` (E,) rows per group of ``rows`` rows sorted by group. Returns each row's place
    in the padded layout, the groups' ends there (int32, for ``_grouped_mm``) and the padded
    row count. The count depends on ``rows`` and E alone (static under compile, no host read);
    the last group absorbs the tail, so no output row is left uncomputed.
    """
    n_groups = counts.shape[0]
    capacity = -(-(rows + n_groups * (align - 1)) // align) * align
    padded = (counts + align - 1) // align * align
    padded_starts = torch.cumsum(padded, 0) - padded
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(
        torch.arange(n_groups, device=counts.device), counts, output_size=rows
    )
    place = torch.arange(rows, device=counts.device) - starts[group] + padded_starts[group]
    ends = torch.cat([padded_starts[1:], padded_starts.new_full((1,), capacity)])
    return place, ends.to(torch.int32), capacity


def swiglu_experts(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """``x`` (M, d) sorted by expert, ``counts`` (E,) tokens per expert, weights (E, ., .).
    Each expert's rows are padded with zero rows to a multiple of ``GROUP_ALIGN`` (see
    ``aligned_groups``); padding rows meet no weight gradient and are dropped from the output."""
    place, offs, capacity = aligned_groups(counts, x.shape[0])
    padded = x.new_zeros(capacity, x.shape[1]).index_copy(0, place, x)
    h = F.silu(grouped_mm(padded, w1, offs)) * grouped_mm(padded, w3, offs)
    return grouped_mm(h, w2, offs)[place]


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights; sharded on dim 0 under expert parallelism."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.compute = swiglu_experts  # compiled by apply_compile, outside FSDP's hooks

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (M, d) sorted by local expert, ``counts`` (E_local,) tokens per local expert."""
        return self.compute(
            x, counts, local_shard(self.w1), local_shard(self.w3), local_shard(self.w2)
        )


def host_split_sizes(send: torch.Tensor, recv: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows this rank sends to and receives from each EP rank, as Python ints: an all-to-all
    with uneven splits needs them on the host. This is the step's one deliberate device-to-host
    read, once per MoE layer and forward under expert parallelism (none without it)."""
    sizes = torch.stack([send.sum(1), recv.sum(1)]).tolist()
    return sizes[0], sizes[1]


class TokenDispatcher:
    """Moves routed tokens to the rank that owns their expert and back (expert parallelism).

    `parallelize` sets the EP mesh; without one this is a plain local call of the experts.
    """

    def __init__(self) -> None:
        self.ep_mesh: DeviceMesh | None = None

    def run(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Apply ``experts`` to ``x`` (sorted by global expert id; ``counts`` per global expert)."""
        if self.ep_mesh is None:
            return experts(x, counts)
        group = self.ep_mesh.get_group()
        ep = self.ep_mesh.size()
        recv_counts = funcol.all_to_all_single(counts, None, None, group)
        send = counts.view(ep, -1)
        recv = recv_counts.view(ep, -1)  # [source rank, local expert]
        input_splits, output_splits = host_split_sizes(send, recv)
        received = funcol.all_to_all_single_autograd(x, output_splits, input_splits, group)
        # Received rows come grouped by source rank, then expert: regroup them by expert.
        n_local = recv.shape[1]
        local_expert = torch.arange(n_local, device=x.device).repeat(ep)
        row_expert = torch.repeat_interleave(
            local_expert, recv.flatten(), output_size=sum(output_splits)
        )
        order = torch.argsort(row_expert, stable=True)
        y = experts(received[order], recv.sum(0))
        unsorted = torch.empty_like(y).index_copy(0, order, y)
        return funcol.all_to_all_single_autograd(unsorted, input_splits, output_splits, group)


def sum_over_mesh(x: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum ``x`` over ``mesh``; every rank gets the sum and its own gradient passes through
    unchanged (DTensor keeps the backward of Partial -> Replicate replicated)."""
    if mesh is None:
        return x
    return DTensor.from_local(x, mesh, [Partial()]).full_tensor()


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with a per-sequence load-balancing loss."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, n_experts)
        self.dispatcher = TokenDispatcher()
        self.tp_mesh: DeviceMesh | None = None  # set under TP: x is then a sequence shard
        # Set under CP and/or TP: the ranks whose shards make up one sequence.
        self.sequence_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (B, S_local, d): the whole sequence, or this TP rank's shard of it; ``mask``
        (B, S) true on real positions of the whole sequence. Returns (output like x, aux loss)."""
        tokens, counts, order, weights, aux = self.route(x, mask)
        y = self.dispatcher.run(self.experts, tokens, counts)
        return self.combine(y, order, weights).view_as(x), aux

    def route(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tokens sorted by expert (one row per routed slot), tokens per expert, the sort order,
        the slots' combine weights and the balance loss. Static shapes throughout."""
        B, S, d = x.shape
        if self.tp_mesh is not None:
            mask = mask.chunk(self.tp_mesh.size(), dim=1)[self.tp_mesh.get_local_rank()]
        # The router sees rows (B * S, d): under TP a row-sharded matrix, whose sharding DTensor
        # propagates with dynamic batch and sequence sizes (a (B, S, d) sequence shard it cannot).
        logits = self.router(x.reshape(B * S, d)).view(B, S, -1)
        probs = torch.softmax(logits.float(), dim=-1)
        top_p, top_e = torch.topk(probs, self.top_k, dim=-1)
        weights = (top_p / top_p.sum(-1, keepdim=True)).to(x.dtype)
        aux = self.balance_loss(probs, top_e, mask)
        experts_flat = top_e.reshape(-1)
        order = torch.argsort(experts_flat, stable=True)
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, experts_flat, torch.ones_like(experts_flat))
        tokens = x.reshape(B * S, d)[order // self.top_k]
        return tokens, counts, order, weights.reshape(B * S, self.top_k), aux

    def combine(self, y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's output (tokens, d): its slots' expert outputs, weighted and summed."""
        per_slot = torch.empty_like(y).index_copy(0, order, y).view(-1, self.top_k, y.shape[-1])
        return (per_slot * weights.unsqueeze(-1)).sum(1)

    def balance_loss(
        self, probs: torch.Tensor, top_e: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Switch-style E * sum_e f_e * P_e per sequence over real positions, summed over
        sequences.

        Per sequence (not per batch), and summed, so that the trainer's division by the global
        number of sequences gives the same loss however the batch is split: over data-parallel
        ranks, microbatches or accumulation steps (a padding sequence adds nothing). Under CP and
        TP the per-sequence sums add up the sequence shards.
        """
        m = mask.to(probs.dtype).unsqueeze(-1)  # (B, S, 1)
        # How often each expert was picked per position, (B, S, E): one_hot would check the
        # indices' range on the host (a sync on CPU), scatter_add does not.
        picked = torch.zeros_like(probs).scatter_add_(
            -1, top_e, torch.ones_like(top_e, dtype=probs.dtype)
        )
        sums = torch.cat([(picked * m).sum(1), (probs * m).sum(1), m.sum(1)], dim=-1)
        sums = sum_over_mesh(sums, self.sequence_mesh)
        E = self.n_experts
        tokens, prob_mass, n = sums[:, :E], sums[:, E : 2 * E], sums[:, 2 * E :].clamp(min=1)
        frac_tokens = tokens / (n * self.top_k)
        frac_probs = prob_mass / n
        return (E * (frac_tokens * frac_probs).sum(-1)).sum()
