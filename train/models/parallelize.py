"""Applies the parallel layout to a SALM model, in torchtitan's order:
TP (with sequence parallel) and EP -> activation checkpointing -> torch.compile -> FSDP2 or DDP.

Only the LLM gets tensor parallelism; the audio encoder (the own one or a pretrained Whisper or
Parakeet), projector and embeddings run replicated over TP (FSDP still shards them), except a
tied embedding, which is the output head's matrix and so split over the vocabulary like the
head. The same code runs CUDA+NCCL and CPU+gloo, and parallelizes a whole model or one pipeline
stage of it (a `PipelinePart`: the same modules under the same names, some of them absent).

Activation checkpointing wraps each block in a checkpoint wrapper (``full``: recompute the
block's matmuls and elementwise work in backward, keeping only the outputs of its collectives and
attention; ``selective``: also keep the matmuls' outputs, recompute only elementwise work;
``selective_op``, torchtitan's per-op policy: keep every second matmul's output).
Compilation then compiles each (wrapped) block's forward in place with ``fullgraph=True``: a
graph break is an error, never a silent fall-back to eager, parameter names stay those of the
plain model, and each stack is a region with its own recompile budget (``train.models.compiled``
holds the shape policy).

The model may live on the meta device: every step here only places and wraps parameters, so the
caller materializes each rank's shards afterwards (``to_empty`` + ``init_weights``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from train.models.compiled import compile_region
from train.models.lora import ADAPTER, LORA_A, LORA_B
from train.models.moe import MoE
from train.models.salm import BLOCK_DIMS, SALM, Block
from train.parallel.dims import AC_MODES, DEFAULT_LOSS_CHUNK, SELECTIVE_OP
from train.parallel.mesh import Meshes

if TYPE_CHECKING:
    from train.models.pipeline import PipelinePart

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
# Both AC modes keep the outputs of collectives and attention: communication is never worth
# repeating in backward, and attention's output is one activation of the block's width. (Full
# recomputation of attention in a compiled TP block also fails in AOT autograd, which would
# have to save a DeviceMesh.)
_KEPT_BY_FULL = frozenset(
    {
        _c10d.reduce_scatter_tensor.default,
        _c10d.all_gather_into_tensor.default,
        _c10d.all_to_all_single.default,
        _c10d.all_reduce.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)
# The matmuls: selective AC keeps all their outputs and recomputes only cheap elementwise work;
# selective_op keeps every second one's.
_MATMULS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten._grouped_mm.default,
        torch.ops.salm.grouped_mm_fp32.default,
    }
)
_KEPT_BY_SELECTIVE = _KEPT_BY_FULL | _MATMULS


@dataclass(frozen=True)
class ParallelizeOptions:
    strategy: str = "fsdp2"  # "fsdp2" (FSDP, or HSDP with dp_replicate > 1) or "ddp"
    activation_checkpointing: str = "none"  # one of AC_MODES
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend (see TrainConfig)
    mixed_precision: bool = True  # bf16 compute on CUDA: FSDP2 params, or autocast under ddp
    loss_chunk: int = DEFAULT_LOSS_CHUNK  # positions whose logits the loss holds at once


def block_lists(model: SALM | PipelinePart) -> list[nn.ModuleList | nn.ModuleDict]:
    """The containers of transformer blocks ``model`` holds (a pipeline part may lack some)."""
    lists: list[nn.ModuleList | nn.ModuleDict] = [model.llm.layers]
    if model.encoder is not None:
        lists.insert(0, model.encoder.layers)
    return lists


def block_regions(model: SALM | PipelinePart) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
    """The compiled region of each of ``block_lists(model)``, with the dimensions of its blocks'
    positional arguments that vary between batches (a pretrained encoder's blocks take their
    own arguments)."""
    regions = [("decoder_block", BLOCK_DIMS)]
    if model.encoder is not None:
        regions.insert(0, ("encoder_block", model.encoder.block_dims))
    return regions


def parallelize(
    model: SALM | PipelinePart, meshes: Meshes, options: ParallelizeOptions
) -> SALM | PipelinePart:
    """Parallelize ``model`` in place (on the meta device, or initialized identically)."""
    dims = meshes.dims
    model.loss_chunk = options.loss_chunk
    if dims.cp_enabled:
        apply_cp(model, meshes)
    if dims.tp_enabled:
        apply_tp(model, meshes)
    if model.cfg.n_experts:
        apply_moe_parallel(model, meshes)
    blocks = block_lists(model)
    if options.activation_checkpointing != "none":
        for layers in blocks:
            apply_ac(layers, options.activation_checkpointing)
    if options.compile:
        for layers, (region, dims) in zip(blocks, block_regions(model), strict=True):
            apply_compile(layers, region, dims, options.compile_backend)
    if options.strategy == "ddp":
        replicate(model, device_mesh=meshes.dp)
    elif needs_fsdp(meshes, options):
        apply_fsdp(model, meshes, options)
    return model


def needs_fsdp(meshes: Meshes, options: ParallelizeOptions) -> bool:
    """Whether FSDP has work to do: shard over more than one rank, cast to bf16, scale the
    experts' gradients under EP, or follow TP. Under TP, FSDP (even over one shard) makes every
    parameter a DTensor, which fused AdamW needs (it takes one kind of tensor), and reduces
    over the TP ranks the gradients TP leaves partial: the replicated norms' and router's, and
    the experts' (each TP rank runs its own tokens through whole experts). Otherwise (one
    process, or ranks that only split the model by CP or pipeline stages, in full precision)
    its hooks would only cost time."""
    dims = meshes.dims
    return (
        meshes.fsdp.size() > 1
        or dims.ep_enabled
        or dims.tp_enabled
        or fsdp_mixed_precision(meshes, options)
    )


def apply_cp(model: SALM | PipelinePart, meshes: Meshes) -> None:
    """Context parallelism on the LLM (``train.models.context``): the sequence is cut into
    2 * cp chunks as it enters the LLM (then, under TP, each rank's part into tp shards), and
    every attention gathers the keys and values of the whole sequence."""
    cp_mesh = meshes.cp
    model.seq_multiple = meshes.dims.seq_multiple
    model.llm.cp_mesh = cp_mesh
    for block in model.llm.layers.values():
        block.attn.cp_mesh = cp_mesh


def apply_tp(model: SALM | PipelinePart, meshes: Meshes) -> None:
    """Megatron-style TP with sequence parallelism on the LLM.

    Between blocks the residual stream is this rank's sequence shard (a local tensor); norms run
    on shards, attention and dense FFNs all-gather the sequence and reduce-scatter their output,
    MoE FFNs work on the shard itself. The part that builds the sequence (the whole model, or
    the first pipeline stage) cuts it into shards as it enters the LLM; later stages receive
    shards.
    """
    tp_mesh = meshes.tp
    model.seq_multiple = meshes.dims.seq_multiple
    llm = model.llm
    if model.encoder is not None:
        parallelize_module(
            llm,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), None),
                desired_input_layouts=(Shard(1), None),
                use_local_output=True,
            ),
        )
    if llm.lm_head is not None:
        parallelize_module(
            llm,
            tp_mesh,
            {
                "norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )
    if llm.tied:
        # One matrix, one placement: the embedding is split over the vocabulary like the head
        # (each rank looks up the ids it holds, the rows are summed over TP).
        vocab_split = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        parallelize_module(llm.embed, tp_mesh, vocab_split)
        llm.tie_head()
    for block in llm.layers.values():
        parallelize_module(block, tp_mesh, _with_adapters(block, _block_plan(block)))


class ReplicateParameters(ParallelStyle):
    """Every parameter whole on each TP rank (a DTensor replicated over TP); inputs and outputs
    untouched. For a LoRA A that reads the replicated input of a column-parallel layer."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


def _with_adapters(block: Block, plan: dict) -> dict:
    """``plan`` for a block whose projections may carry LoRA adapters (``train.models.lora``):
    the base layer takes the projection's style; a column-parallel base keeps A whole and
    splits B like itself; a row-parallel base splits A like itself (its partial output
    reduce-scattered over the sequence) and keeps B whole on the sequence shard."""
    adapted = {}
    for name, style in plan.items():
        module = block.get_submodule(name)
        if not hasattr(module, "base_layer"):
            adapted[name] = style
            continue
        adapted[f"{name}.base_layer"] = style
        a, b = f"{name}.{LORA_A}.{ADAPTER}", f"{name}.{LORA_B}.{ADAPTER}"
        if isinstance(style, ColwiseParallel):
            adapted[a], adapted[b] = ReplicateParameters(), ColwiseParallel()
        else:
            adapted[a] = RowwiseParallel(output_layouts=Shard(1))
            adapted[b] = SequenceParallel(use_local_output=True)
    return adapted


def _block_plan(block: Block) -> dict:
    plan = {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if block.moe is None:
        plan.update(
            {
                "ffn": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "ffn.w1": ColwiseParallel(),
                "ffn.w3": ColwiseParallel(),
                "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
    else:
        # The MoE takes and returns this rank's sequence shard as a local tensor; its router
        # takes that shard's rows (B * S_local, d) as rows of the sequence-parallel input, so
        # DTensor sums the router's weight gradient over TP.
        plan["moe"] = PrepareModuleInput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Shard(1), None),
            use_local_output=True,
        )
        plan["moe.router"] = SequenceParallel(sequence_dim=0, use_local_output=True)
    return plan


def _moe_layers(model: SALM | PipelinePart) -> list[MoE]:
    return [block.moe for block in model.llm.layers.values() if block.moe is not None]


def apply_moe_parallel(model: SALM | PipelinePart, meshes: Meshes) -> None:
    """Give each MoE its TP and EP meshes; under EP shard the stacked experts over the EP view."""
    dims = meshes.dims
    for moe in _moe_layers(model):
        if dims.tp_enabled:
            moe.tp_mesh = meshes.tp
        moe.sequence_mesh = meshes.sequence
        if dims.ep_enabled:
            moe.dispatcher.ep_mesh = meshes.ep
            for name, param in list(moe.experts.named_parameters()):
                sharded = distribute_tensor(param.data, meshes.ep, [Shard(0)], src_data_rank=None)
                moe.experts.register_parameter(name, nn.Parameter(sharded))


def draws_out_of_place(op) -> bool:
    """Whether ``op`` draws random numbers into a new tensor (``native_dropout``, a functional
    ``bernoulli``, ``rand_like``): checkpointing keeps its output rather than draw again. An
    in-place draw (eager ``bernoulli_`` into a fresh tensor, CPU dropout's) fills a tensor that
    later ops read, so it must run again in the recompute, replayed by ``preserve_rng_state``."""
    schema = getattr(op, "_schema", None)
    if schema is None or torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    return not schema.is_mutable


def _policy(kept: frozenset):
    def policy(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
        if op in kept or draws_out_of_place(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _every_second_matmul_contexts():
    """The contexts of one checkpointed call under ``selective_op``: what ``full`` keeps, and
    the 1st, 3rd, 5th ... matmul's output (a dense block: wq, wv, w1 and w2; wk, wo and w3
    recomputed), counted apart in the forward and in the recompute, which sees the same ops in
    the same order."""
    seen = {False: 0, True: 0}  # matmuls so far, by ctx.is_recompute

    def policy(ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
        if op in _MATMULS:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        if op in _KEPT_BY_FULL or draws_out_of_place(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(layers: nn.ModuleList | nn.ModuleDict, mode: str) -> None:
    """Activation checkpointing (``full``, ``selective`` or ``selective_op``) for each block
    of ``layers``.

    A dense block is wrapped whole. An MoE block is checkpointed as its pieces around the token
    dispatcher, the boundary compilation uses too: FSDP's hooks on the experts must stay outside
    a selectively checkpointed region (SAC refuses the ops they issue in the recompute), and the
    dispatcher's all-to-all outputs are worth keeping anyway.

    The recompute uses the forward's random draws, so dropout (LoRA's, a pretrained encoder's)
    masks the recomputed activations as it masked the forward's: a draw into a new tensor is
    kept (``draws_out_of_place``: CUDA's ``native_dropout``, and every draw under torch.compile,
    whose graphs are functional), an in-place one runs again from the generator states saved
    before the block (``preserve_rng_state``). Keeping compiled draws also keeps AOT autograd
    from replaying them with ``functionalize_rng_ops``, which fails to partition the graph on a
    GPU under torch 2.11 ("Node ... was invalid, but is output").
    """
    if mode not in AC_MODES or mode == "none":
        raise ValueError(f"activation_checkpointing={mode}: choose one of {', '.join(AC_MODES)}")
    if mode == SELECTIVE_OP:
        options = {"context_fn": _every_second_matmul_contexts}
    else:
        policy = _policy(_KEPT_BY_SELECTIVE if mode == "selective" else _KEPT_BY_FULL)
        options = {"context_fn": partial(create_selective_checkpoint_contexts, policy)}
    for key, block in _items(layers):
        if getattr(block, "moe", None) is None:  # a dense Block, or a pretrained encoder's
            layers[key] = checkpoint_wrapper(block, preserve_rng_state=True, **options)
            continue
        moe = block.moe
        block.mix = _checkpointed(block.mix, options)
        moe.route = _checkpointed(moe.route, options)
        moe.combine = _checkpointed(moe.combine, options)
        moe.experts.compute = _checkpointed(moe.experts.compute, options)


def _items(layers: nn.ModuleList | nn.ModuleDict) -> list[tuple[int | str, nn.Module]]:
    if isinstance(layers, nn.ModuleDict):
        return list(layers.items())
    return list(enumerate(layers))


def _checkpointed(fn: Callable, options: dict) -> Callable:
    def run(*args):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **options)

    return run


def apply_compile(
    layers: nn.ModuleList | nn.ModuleDict,
    region: str,
    dims: tuple[tuple[int, ...], ...],
    backend: str,
) -> None:
    """Compile each block of ``layers`` in place by ``backend`` with ``fullgraph=True`` (a graph
    break fails loudly), under the code object of ``region`` (see ``train.models.compiled``);
    ``dims``: the dimensions of the blocks' positional arguments that vary between batches.

    A dense block compiles its (checkpointed) forward; FSDP's and the wrappers' hooks run
    around it in eager. An MoE block compiles as its pieces around the token dispatcher (see
    ``train.models.moe``): the attention half (``Block.mix``), the routing, the experts'
    matmuls and the combine, each a region of its own.
    """
    for _, block in _items(layers):
        # A dense Block, a pretrained encoder's block, or a checkpoint wrapper (which forwards
        # ``moe``).
        if getattr(block, "moe", None) is None:
            block.forward = compile_region(block.forward, region, dims, backend)
            continue
        block.mix = compile_region(block.mix, "moe_mix", dims[:4], backend)
        moe = block.moe
        moe.route = compile_region(moe.route, "moe_route", ((0, 1), (0, 1)), backend)
        moe.combine = compile_region(moe.combine, "moe_combine", ((0,), (0,), (0,)), backend)
        moe.experts.compute = compile_region(moe.experts.compute, "moe_experts", ((0,),), backend)


def fsdp_mixed_precision(meshes: Meshes, options: ParallelizeOptions) -> bool:
    on_cuda = meshes.dense.device_type == "cuda"
    return options.mixed_precision and options.strategy == "fsdp2" and on_cuda


def compute_autocast(
    options: ParallelizeOptions, device_type: str
) -> contextlib.AbstractContextManager:
    """The forward's autocast: bf16 for ddp on CUDA (FSDP2 casts its parameters instead)."""
    if options.mixed_precision and options.strategy == "ddp" and device_type == "cuda":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def mixed_precision_policies(bf16: bool) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """(root policy, inner policy). The root casts the model's float inputs to bf16 once; inner
    modules do not cast theirs, so the fp32 RoPE tables reach every block in fp32."""
    if not bf16:
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    inner = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    return root, inner


def apply_fsdp(model: SALM | PipelinePart, meshes: Meshes, options: ParallelizeOptions) -> None:
    """fully_shard each block, the experts on their own mesh, then the root.

    A pipeline stage runs one forward per microbatch: it keeps its blocks' parameters gathered
    from forward to backward instead of gathering them again for every microbatch (more memory
    per stage, as in torchtitan under PP). The root (embedding, encoder stem, projector, final
    norm, head) is resharded after forward too, and gathered again when backward reaches the
    model's output (``SALMOutput`` is a pytree for that).
    """
    root_policy, policy = mixed_precision_policies(fsdp_mixed_precision(meshes, options))
    shard = partial(fully_shard, reshard_after_forward=not meshes.dims.pp_enabled)
    if model.encoder is not None:
        for block in model.encoder.layers:
            shard(block, mesh=meshes.fsdp, mp_policy=policy)
    for block in model.llm.layers.values():
        if block.moe is not None:
            _shard_experts(block.moe, meshes, policy)
        shard(block, mesh=meshes.fsdp, mp_policy=policy)
    shard(model, mesh=meshes.fsdp, mp_policy=root_policy)
    if meshes.dims.ep_enabled:
        _prefetch_explicitly(list(model.llm.layers.values()))


def _shard_experts(moe: MoE, meshes: Meshes, mp_policy: MixedPrecisionPolicy) -> None:
    """FSDP for the experts over the ranks that hold the same experts (the efsdp view).

    Expert gradients arrive summed over the EP group (all-to-all) and over CP and TP (each rank
    computed its own tokens), so FSDP must divide by the ranks every loss is scaled by (dp x cp),
    not by its mesh.
    Dim 0 (experts) is sharded while every efsdp rank still gets whole experts; beyond that the
    hidden dim is. Replicas (HSDP) hold copies, so they do not count.
    """
    dims = meshes.dims
    mesh = meshes.expert_fsdp
    placement = Shard(1) if dims.efsdp * dims.ep > moe.n_experts else Shard(0)
    experts = fully_shard(
        moe.experts,
        reshard_after_forward=not dims.pp_enabled,
        mesh=mesh,
        mp_policy=mp_policy,
        shard_placement_fn=lambda _param: placement,
    )
    if mesh.size() != dims.gradient_ranks:
        experts.set_gradient_divide_factor(float(dims.gradient_ranks))
        if mesh.device_type != "cuda" and dims.efsdp > 1:
            # gloo has no PREMUL_SUM. Not with efsdp == 1: FSDP then divides while copying
            # instead of reduce-scattering, and forced sums would divide a second time.
            experts.set_force_sum_reduction_for_comms(True)


def _prefetch_explicitly(blocks: list[FSDPModule]) -> None:
    """Under EP each MoE layer syncs with the host (split sizes), which defeats FSDP's implicit
    prefetch: name the next block (and its experts) to all-gather, forward and backward."""

    def with_experts(block) -> list[FSDPModule]:
        return [block, block.moe.experts] if block.moe is not None else [block]

    for block, following in itertools.pairwise(blocks):
        block.set_modules_to_forward_prefetch(with_experts(following))
        following.set_modules_to_backward_prefetch(with_experts(block))
