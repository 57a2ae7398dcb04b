"""The output head and its cross-entropy, a chunk of positions at a time: the fp32 logits of all
positions are never held. At vocabulary 128,256 and 16K positions they are 8 GiB, their bf16
copy 4 GiB more and their gradient as much again; here one chunk's logits and their gradient
are (``train.loss_chunk`` positions, 0.5 GiB each at 1,024).

The forward computes each chunk's logits, keeps their log-sum-exp (4 bytes a position) and
drops them; the backward computes them again, chunk by chunk, for the gradients of the hidden
states and of the head: one more matmul of the head's size, the price of the memory. Under TP
the head is split over the vocabulary (its rows; the tied embedding's too): each rank computes
the logits of its rows, the maximum, the sum of exponentials and the target's logit are reduced
over the TP group, and the hidden states' gradient is summed over it. The loss and gradients
are those of ``F.cross_entropy`` over ``F.linear``'s full logits within fp32 rounding (the sum
of exponentials in another order: ~1e-7 relative, tests/test_head_loss.py).

Written in torch rather than taken from liger-kernel's fused linear cross-entropy or
cut-cross-entropy: both are Triton kernels (GPU only, so this machine's tests could not run
them) without a vocabulary-parallel head, and neither knows DTensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from train.models.packing import IGNORE_INDEX


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` (this rank's vocabulary rows from
    ``vocab_start``) against ``labels``, a chunk of positions at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, vocab_start: int, group):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (hidden[rows] @ weight.t()).float()
            lse[rows], target = _lse_and_target(logits, labels[rows], vocab_start, group)
            total += torch.where(labels[rows] != IGNORE_INDEX, lse[rows] - target, 0.0).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.vocab_start, ctx.group = chunk, vocab_start, group
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        # Summed over chunks in fp32, rounded to the weight's dtype once, as one matmul would.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits = (hidden[rows] @ weight.t()).float()
            grad = logits.sub_(lse[rows, None]).exp_()  # softmax over the whole vocabulary
            local, owned = _owned(labels[rows], ctx.vocab_start, weight.shape[0])
            # Minus one at each owned target, through the flat view: scatter_add_ on a
            # one-dimensional CUDA tensor has a deterministic kernel (debug.deterministic).
            at = torch.arange(local.shape[0], device=local.device) * weight.shape[0] + local
            grad.view(-1).scatter_add_(0, at, -owned.to(grad.dtype))
            grad *= ((labels[rows] != IGNORE_INDEX) * grad_total)[:, None]
            grad = grad.to(weight.dtype)
            grad_hidden[rows] = grad @ weight
            grad_weight += grad.t() @ hidden[rows]
        if ctx.group is not None:  # each rank's rows gave their part of the hidden gradient
            dist.all_reduce(grad_hidden, group=ctx.group)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def _owned(labels: torch.Tensor, vocab_start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's row in this rank's part of the head (clamped), and whether it is there."""
    local = labels - vocab_start
    owned = (labels != IGNORE_INDEX) & (local >= 0) & (local < rows)
    return local.clamp(0, max(rows - 1, 0)), owned


def _lse_and_target(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's log-sum-exp over the whole vocabulary and its target's logit."""
    local, owned = _owned(labels, vocab_start, logits.shape[1])
    target = torch.where(owned, logits.gather(1, local[:, None])[:, 0], 0.0)
    if group is None:
        return torch.logsumexp(logits, dim=1), target
    peak = logits.max(dim=1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([torch.exp(logits - peak[:, None]).sum(dim=1), target])
    dist.all_reduce(sums, group=group)
    return peak + torch.log(sums[0]), sums[1]


def head_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Summed next-token cross-entropy, in fp32, of the head ``weight`` (vocab, d) over the
    final normed ``hidden`` states (..., d) at the positions ``labels`` marks. Under TP
    ``hidden`` is this rank's sequence shard and ``weight`` split over the vocabulary."""
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        (placement,) = weight.placements
        if placement != Shard(0):
            raise ValueError(f"the head must be split over its vocabulary rows, not {placement}")
        mesh = weight.device_mesh
        rows_per_rank = -(-weight.shape[0] // mesh.size())  # torch.chunk's split of Shard(0)
        group, vocab_start = mesh.get_group(), mesh.get_local_rank() * rows_per_rank
        if not isinstance(hidden, DTensor):  # this rank's sequence shard, as a local tensor
            hidden = DTensor.from_local(hidden, mesh, [Shard(1)])
        hidden = hidden.redistribute(mesh, [Replicate()]).to_local()
        weight = weight.to_local()
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # ddp's bf16: the matmuls in autocast's dtype, as
        # F.linear's; cast here, so that the backward's recomputed logits are the forward's
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    flat = hidden.reshape(-1, hidden.shape[-1])
    with torch.autocast(device, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            flat, weight, labels.reshape(-1), chunk, vocab_start, group
        )
