"""Compiled regions that hold up on real batches: the shape policy of ``compile=true``.

Dynamo keeps its compiled graphs per *code object* and allows ``recompile_limit`` (8) of them
per object; with ``fullgraph=True`` one more is a hard ``FailOnRecompileLimitHit``. Real
training asks for more graphs than fixed synthetic batches do: lhotse's buckets change the
batch size and lengths every step, validation runs under ``no_grad`` (a guard of its own), and
a batch of one utterance specializes the batch dimension to 1. So:

- **One code object per region.** Every compiled region (``encoder_block``, ``decoder_block``,
  and an MoE block's ``moe_mix``, ``moe_route``, ``moe_combine``, ``moe_experts``) runs under
  a code object of its own (a copy of its function's, renamed), shared by the blocks of that
  region only. The encoder and the decoder no longer share one budget, nor one
  automatic-dynamic state, nor do an MoE block's four pieces (which, checkpointed, were all
  the same closure).
- **Dynamic batch and length dimensions from the first call.** The tensors that enter a
  region have their batch and sequence dimensions marked dynamic as they enter it, so the
  first graph already serves every batch shape: no static first graph, no automatic-dynamic
  recompile. Model widths and parameters stay static. Inputs that are views are copied, so
  every call presents the same kind of tensor to dynamo's guards.
- **A bounded number of graphs.** What remains is one graph per grad mode (training,
  validation) times batch size one or more: at most 4 per region, half the limit. The
  decoder's length is a multiple of ``SALM.seq_multiple`` (8, and whatever TP and CP need),
  which keeps the sequence splits exact; nothing else is padded, so the loss and the data
  stream are those of eager.

``graph_counts`` reads how many graphs each region holds (dynamo's cache entries); the trainer
logs the total beyond one per region as ``recompiles``.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Graphs a region may need under this policy: (training, validation) x (batch 1, batch > 1).
GRAPHS_PER_REGION = 4

# (region name, original code object) -> the region's own code object, shared by its blocks.
_REGIONS: dict[tuple[str, types.CodeType], types.CodeType] = {}


def compile_region(
    fn: Callable, region: str, dynamic: Sequence[tuple[int, ...]], backend: str = "inductor"
) -> Callable:
    """``fn`` (a function or a bound method) compiled by ``backend`` with ``fullgraph=True``
    under the code object of ``region``: every callable compiled for the same region and
    function shares its graphs, and no other region spends its recompile budget.

    ``dynamic[i]`` lists the dimensions of positional argument ``i`` that vary between batches.
    They are marked as the call enters the region, after any hook that replaced the arguments
    (FSDP's pre-forward hook does), and an argument that is a view is copied first: dynamo
    guards a view's base, so a first block fed a view (a linear layer's output under
    ``no_grad``, FSDP's hooked input) and later blocks fed fresh tensors would need a graph
    each. The copy costs one elementwise pass over a block's input.
    """
    func = getattr(fn, "__func__", fn)
    key = (region, func.__code__)
    code = _REGIONS.setdefault(key, func.__code__.replace(co_name=region))
    own = types.FunctionType(code, func.__globals__, region, func.__defaults__, func.__closure__)
    own.__kwdefaults__ = func.__kwdefaults__
    bound_to = getattr(fn, "__self__", None)
    compiled = torch.compile(
        own if bound_to is None else types.MethodType(own, bound_to),
        fullgraph=True,
        backend=backend,
    )

    def enter(*args: Any, **kwargs: Any) -> Any:
        marked = list(args)
        for index, dims in enumerate(dynamic):
            marked[index] = region_input(args[index], dims)
        return compiled(*marked, **kwargs)

    return enter


def graph_counts() -> dict[str, int]:
    """Graphs each compiled region holds now (regions that have not run yet hold none)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # dynamo: ~1 s to import

    counts: dict[str, int] = {}
    for (region, _), code in _REGIONS.items():
        counts[region] = counts.get(region, 0) + len(_debug_get_cache_entry_list(code))
    return counts


def recompiles(counts: dict[str, int]) -> int:
    """Graphs beyond the first of each region that has compiled."""
    return sum(max(0, n - 1) for n in counts.values())


def describe_graphs(counts: dict[str, int]) -> str:
    """One line for the log: graphs per region against dynamo's per-region limit."""
    regions = ", ".join(f"{region} {n}" for region, n in sorted(counts.items()) if n)
    limit = torch._dynamo.config.recompile_limit
    return f"compiled graphs per region: {regions or 'none'} (limit {limit} per region)"


def region_input(tensor: Any, dims: tuple[int, ...]) -> Any:
    """``tensor`` (or None) as a region receives it: not a view, ``dims`` marked dynamic (a
    dimension of size 1 may still specialize: the batch of one)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    if tensor._base is not None:
        tensor = tensor.clone()
    torch._dynamo.maybe_mark_dynamic(tensor, list(dims))
    return tensor
