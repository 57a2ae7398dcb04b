"""Applies the parallel layout to a SALM model, in torchtitan's order:
TP (with sequence parallel) and EP -> activation checkpointing -> torch.compile -> FSDP2 or DDP.

Only the LLM gets tensor parallelism; the audio encoder, projector and embeddings are small and
run replicated over TP (FSDP still shards them). The same code runs CUDA+NCCL and CPU+gloo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable import checkpoint, replicate
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from train.mesh import Meshes
from train.models.moe import MoE
from train.models.salm import SALM, Block


@dataclass(frozen=True)
class ParallelizeOptions:
    strategy: str = "fsdp2"  # "fsdp2" (FSDP, or HSDP with dp_replicate > 1) or "ddp"
    activation_checkpointing: bool = False
    compile: bool = False
    mixed_precision: bool = True  # bf16 params, fp32 reductions; CUDA with fsdp2 only


def parallelize(model: SALM, meshes: Meshes, options: ParallelizeOptions) -> SALM:
    """Parallelize ``model`` in place (initialize it identically on every rank first)."""
    dims = meshes.dims
    if dims.tp_enabled:
        apply_tp(model, meshes)
    if model.cfg.n_experts:
        apply_moe_parallel(model, meshes)
    if options.activation_checkpointing:
        for block in [*model.encoder.layers, *model.llm.layers]:
            checkpoint(block)
    if options.compile:
        for block in [*model.encoder.layers, *model.llm.layers]:
            block.compile()
    policy = mixed_precision_policy(meshes, options)
    if options.strategy == "ddp":
        replicate(model, device_mesh=meshes.dp)
    elif dims.world_size > 1 or policy.param_dtype is not None:
        apply_fsdp(model, meshes, policy)
    # else one process in full precision: nothing to shard, and FSDP's hooks would only cost time.
    return model


def apply_tp(model: SALM, meshes: Meshes) -> None:
    """Megatron-style TP with sequence parallelism on the LLM.

    Between blocks the residual stream is this rank's sequence shard (a local tensor); norms run
    on shards, attention and FFNs all-gather the sequence and reduce-scatter their output.
    """
    tp_mesh = meshes.tp
    model.seq_multiple = math.lcm(model.seq_multiple, meshes.dims.tp)
    llm = model.llm
    parallelize_module(
        llm,
        tp_mesh,
        PrepareModuleInput(
            input_layouts=(Replicate(), None),
            desired_input_layouts=(Shard(1), None),
            use_local_output=True,
        ),
    )
    parallelize_module(
        llm,
        tp_mesh,
        {
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in llm.layers:
        parallelize_module(block, tp_mesh, _block_plan(block))


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
        # The MoE sees all tokens (the router runs replicated); its dispatcher splits the expert
        # work between TP ranks and sums it back, so the output is replicated.
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_input=True,
            output_layouts=(Replicate(), None),
            desired_output_layouts=(Shard(1), None),
            use_local_output=True,
        )
    return plan


def _moe_layers(model: SALM) -> list[MoE]:
    return [block.moe for block in model.llm.layers if block.moe is not None]


def apply_moe_parallel(model: SALM, meshes: Meshes) -> None:
    """Give each MoE its TP and EP groups; under EP shard the stacked experts over the EP view."""
    dims = meshes.dims
    for moe in _moe_layers(model):
        if dims.tp_enabled:
            moe.dispatcher.tp_group = meshes.tp.get_group()
        if dims.ep_enabled:
            moe.dispatcher.ep_group = meshes.ep.get_group()
            for name, param in list(moe.experts.named_parameters()):
                sharded = distribute_tensor(param.data, meshes.ep, [Shard(0)])
                moe.experts.register_parameter(name, nn.Parameter(sharded))


def mixed_precision_policy(meshes: Meshes, options: ParallelizeOptions) -> MixedPrecisionPolicy:
    if options.mixed_precision and meshes.dense.device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: SALM, meshes: Meshes, mp_policy: MixedPrecisionPolicy) -> None:
    """fully_shard each block, the experts on their own mesh, then the root."""
    for block in model.encoder.layers:
        fully_shard(block, mesh=meshes.fsdp, mp_policy=mp_policy)
    for block in model.llm.layers:
        if block.moe is not None:
            _shard_experts(block.moe, meshes, mp_policy)
        fully_shard(block, mesh=meshes.fsdp, mp_policy=mp_policy)
    fully_shard(model, mesh=meshes.fsdp, mp_policy=mp_policy)


def _shard_experts(moe: MoE, meshes: Meshes, mp_policy: MixedPrecisionPolicy) -> None:
    """FSDP for the experts over the ranks that hold the same experts (the efsdp view).

    Expert gradients arrive summed over the EP group (all-to-all) and over TP (each TP rank
    computed its own tokens), so FSDP must divide by the data-parallel degree, not by its mesh.
    """
    dims = meshes.dims
    mesh = meshes.expert_fsdp
    placement = Shard(1) if mesh.size() * dims.ep > moe.n_experts else Shard(0)
    experts = fully_shard(
        moe.experts,
        mesh=mesh,
        mp_policy=mp_policy,
        shard_placement_fn=lambda _param: placement,
    )
    if mesh.size() != dims.dp:
        experts.set_gradient_divide_factor(float(dims.dp))
        if mesh.device_type != "cuda" and dims.efsdp > 1:
            # gloo has no PREMUL_SUM. Not with efsdp == 1: FSDP then divides while copying
            # instead of reduce-scattering, and forced sums would divide a second time.
            experts.set_force_sum_reduction_for_comms(True)
