"""A layout's step time: each kind of work at the rate the GPU really reaches for it.

Per GPU and step (docs/planner.md, "Step-time model", gives the figures and their sources):

- **matmuls**: the model's matmul FLOPs on this rank (LLM blocks and head split by TP, PP and
  CP; the encoder whole on every TP and CP rank, as the trainer runs it) at the share of peak
  a bf16 matmul of that width reaches (``matmul_share``, fitted to ``bench/bench_kernels.py``
  on an H100);
- **attention**: flash attention's FLOPs (causal: half the score matrix; backward 2.5 times the
  forward) at the share its kernel reaches for that sequence length (``attention_share``);
- **memory-bound work**: norms, rotary embeddings, SwiGLU, residual adds and casts, in passes
  over the block's activations, more of them in eager than compiled (fused); the loss's fp32
  cross-entropy over the vocabulary; the optimizer and FSDP's copies per parameter; all at the
  HBM bandwidth a copy reaches;
- **recomputation** per activation checkpointing mode: ``full`` redoes each block's forward,
  ``selective`` its memory-bound work;
- **host time**: eager launches every op from Python (more under selective checkpointing, whose
  dispatch mode sees each op twice); the step takes the longer of the GPU's work and the host's;
- **communication**: FSDP's all-gathers and reduce-scatters (and HSDP's all-reduce) run beside
  the compute and combine with it (``costs.overlapped_seconds``), plus the first all-gather of a
  step, which nothing hides; TP's and CP's collectives, EP's all-to-alls and pipeline sends sit
  on the critical path; collectives reach ``BUS_SHARE`` of the link's bandwidth after each
  call's fixed latency (``costs.ring_latency``, NCCL's model: more ranks and nodes, more steps);
- **pipeline**: the ranks' work (their blocks, the head on the last stage, the encoder on the
  first) sets the pace: their mean and a fitted share of the busiest one's excess
  (``costs.pipeline_pace``); the bubble adds (pp - 1) / (microbatches x stages per rank) of it,
  and each microbatch's activations and gradients cross between stages on the critical path
  (``costs.pipeline_transfers``);
- **microbatches**: a small microbatch reaches less of its kernels' speed
  (``costs.microbatch_efficiency``).

A whole step reaches less than the sum of its kernels run alone (allocator, synchronization,
kernels too small to fill the GPU): ``StepConstants.step_efficiency`` divides the GPU's work.
It and the other ``StepConstants`` are fitted to the measured steps of ``measurements.csv``
held in the fit (``planner.fit``); the request carries them (``PlanRequest.constants``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from orchestrator.planner.activations import Microbatch
from orchestrator.planner.costs import (
    P2P_LATENCY_S,
    bubble,
    matmul_share,
    microbatch_efficiency,
    overlapped_seconds,
    pipeline_pace,
    pipeline_transfers,
    ring_latency,
    transfer_seconds,
)
from train.flops import ENCODER_MACS, llm_weights_per_position, loss_recompute_flops
from train.models.shape import SALMConfig, audio_positions, encoder_frames, llm_head_dim
from train.parallel.dims import SELECTIVE_OP, sequence_multiple

if TYPE_CHECKING:
    from orchestrator.planner.request import Layout, PlanRequest

HBM_SHARE = 0.90  # a device-to-device copy: 3.0 of the datasheet's 3.35 TB/s
LOSS_BYTES_PER_LOGIT = 57  # fp32 cross-entropy forward + backward: 2.42 us/token at 128,256
# Memory-bound passes over a block's activations per position in forward, in (model width,
# FFN width) elements of 2 bytes; backward moves BACKWARD_PASSES times as much.
ELEMENTWISE_PASSES = {"eager": (32, 6), "compiled": (8, 2)}
BACKWARD_PASSES = 2
OPTIMIZER_BYTES = 32  # per local parameter: fused AdamW reads p, g, m, v and writes p, m, v
GATHER_BYTES = 8  # per gathered parameter and all-gather: FSDP's bf16 copy-in and copy-out
GRADIENT_BYTES = 10  # per gathered parameter: the bf16 gradient cast to fp32 and reduced
# Host time per block and microbatch (eager: ~120 ops forward and backward from Python), which
# the GPU's work hides when it is longer.
HOST_BLOCK_S = {"eager": 3.5e-3, "compiled": 0.4e-3}
# Eager checkpointing's dispatch mode sees every op of the forward and of its recompute from
# Python while the GPU waits on it (the recomputed kernels are short), per block and microbatch:
# measured as the eager step's growth over no checkpointing, less the GPU's recomputation.
HOST_CHECKPOINT_S = {"selective": 4.1e-3, SELECTIVE_OP: 4.1e-3, "full": 4.6e-3}
BUS_SHARE = 0.80  # NCCL bus bandwidth against the link's one-way figure
# Causal flash attention forward + backward, head width 128: 24% of peak at 1,024 positions,
# 36% at 2,048, 46% at 4,096, 53% at 8,192; share = ATTENTION_SHARE * P / (P + half).
ATTENTION_SHARE = 0.60
ATTENTION_HALF_LENGTH = 1200
ATTENTION_BACKWARD = 2.5  # flash backward: five matmuls against the forward's two
Part = tuple[int, bool, bool]  # a pipeline rank's LLM blocks, whether the encoder, the head


def attention_share(positions: float) -> float:
    return ATTENTION_SHARE * positions / (positions + ATTENTION_HALF_LENGTH)


@cache
def _encoder_train_flops(cfg: SALMConfig, frames: int) -> float:
    """The encoder's and projector's training FLOPs for one sequence (frames > 0)."""
    audio = audio_positions(cfg, frames)
    projector = (cfg.projector_stride * cfg.enc_dim * cfg.d_model + cfg.d_model**2) * audio
    return 6.0 * (ENCODER_MACS[cfg.encoder](cfg, frames) + projector)


@cache
def _llm_weights(cfg: SALMConfig) -> int:
    return llm_weights_per_position(cfg)


@cache
def decoder_positions(cfg: SALMConfig, frames: int, tokens: int, tp: int, cp: int) -> int:
    """One sequence's decoder positions, padded as the trainer pads them under ``tp`` and
    ``cp``."""
    return Microbatch(1, frames, tokens).decoder_positions(cfg, sequence_multiple(tp, cp))


def _passes_bytes(passes: tuple[int, int], width: int, ffn: int) -> float:
    return 2.0 * (passes[0] * width + passes[1] * ffn)


def gpu_work(request: PlanRequest, layout: Layout, part: Part) -> dict[str, float]:
    """Seconds of each kind of GPU work in one step on a rank holding ``part`` (its LLM blocks,
    whether the encoder, whether the head), before overlap."""
    cfg, gpu = request.model, request.cluster.gpu
    peak, hbm = gpu.peak_bf16_flops, gpu.hbm_gbps * 1e9 * HBM_SHARE
    blocks, has_encoder, has_head = part
    mode = "compiled" if request.compiled else "eager"
    sequences = request.global_batch / layout.dp  # per data-parallel rank and step
    positions = decoder_positions(cfg, request.frames, request.tokens, layout.tp, layout.cp)
    local = positions / layout.cp  # positions of one sequence on this rank
    full = layout.ac == "full"
    # Recomputed matmul work, as a share of forward + backward: full redoes the forward (1/3),
    # torchtitan's per-op policy every second matmul of it (1/6).
    recompute_fwd = {"full": 1.0 / 3, SELECTIVE_OP: 1.0 / 6}.get(layout.ac, 0.0)
    # LLM blocks and head; the loss computes the head's logits again in its backward
    # (train/models/head_loss.py): one more forward matmul of the head, whatever the AC mode.
    head_weights = cfg.d_model * cfg.vocab_size
    block_weights = (_llm_weights(cfg) - head_weights) / max(1, cfg.n_layers)
    weights = blocks * block_weights + (head_weights if has_head else 0)
    llm_flops = 6.0 * weights * sequences * local / layout.tp
    chunked = request.loss_chunk > 0 and has_head
    head_recompute = loss_recompute_flops(cfg, sequences * local) / layout.tp if chunked else 0.0
    matmul_flops = llm_flops * (1 + recompute_fwd) + head_recompute
    work = {"matmul": matmul_flops / (peak * matmul_share(cfg.d_model / layout.tp))}
    heads_width = cfg.n_heads * llm_head_dim(cfg) / layout.tp
    causal = 2.0 * positions * positions / 2 * heads_width / layout.cp  # forward, per sequence
    passes = ATTENTION_BACKWARD + 1 + (1 if full else 0)
    attention = blocks * sequences * 2 * causal * passes
    work["attention"] = attention / (peak * attention_share(positions))
    elementwise = _passes_bytes(ELEMENTWISE_PASSES[mode], cfg.d_model, cfg.ffn_hidden)
    elementwise *= 1 + BACKWARD_PASSES + (1 if layout.ac != "none" else 0)
    tokens = sequences * local / layout.tp  # sequence parallel: a TP rank's share
    work["elementwise"] = blocks * tokens * elementwise / hbm
    loss_bytes = sequences * local * cfg.vocab_size * LOSS_BYTES_PER_LOGIT
    work["loss"] = loss_bytes / hbm if has_head else 0.0
    # Audio encoder and projector: whole on every TP and CP rank, on the first stage.
    work["encoder"] = 0.0
    if request.frames and cfg.enc_layers and has_encoder:
        enc_flops = sequences * _encoder_train_flops(cfg, request.frames)
        work["encoder"] = enc_flops * (1 + recompute_fwd) / (peak * matmul_share(cfg.enc_dim))
        frames = encoder_frames(cfg, request.frames)
        enc_bytes = _passes_bytes(ELEMENTWISE_PASSES[mode], cfg.enc_dim, cfg.enc_ffn_hidden)
        enc_bytes *= 1 + BACKWARD_PASSES + (1 if layout.ac != "none" else 0)
        work["encoder"] += cfg.enc_layers * sequences * frames * enc_bytes / hbm
    # Small microbatches reach less of their kernels' speed (costs.microbatch_efficiency).
    share = microbatch_efficiency(layout.microbatch * local, request.constants)
    return {kind: seconds / share for kind, seconds in work.items()}


def host_time(request: PlanRequest, layout: Layout, part: Part) -> tuple[float, float]:
    """(Seconds the host spends issuing one step's blocks on a rank holding ``part``, of which
    the GPU waits for eager checkpointing's share whatever its own work)."""
    cfg = request.model
    llm_blocks, has_encoder, _ = part
    blocks = llm_blocks + (cfg.enc_layers if request.frames and has_encoder else 0)
    blocks *= layout.microbatches
    issue = blocks * HOST_BLOCK_S["compiled" if request.compiled else "eager"]
    checkpointing = 0.0 if request.compiled else blocks * HOST_CHECKPOINT_S.get(layout.ac, 0.0)
    return issue, checkpointing


def parameter_work(request: PlanRequest, layout: Layout, total_params: int, fsdp: bool) -> float:
    """Seconds of the optimizer's and FSDP's passes over the parameters."""
    gathered = total_params / (layout.tp * layout.pp)
    shard = gathered / (layout.dp_shard * layout.cp) if fsdp else gathered
    moved = OPTIMIZER_BYTES * shard
    if fsdp:
        gathers = 2 * layout.microbatches if layout.pp == 1 else 1
        moved += (GATHER_BYTES * gathers + GRADIENT_BYTES) * gathered
    return moved / (request.cluster.gpu.hbm_gbps * 1e9 * HBM_SHARE)


def _bandwidth(request: PlanRequest, span: int) -> float:
    """Bus bytes/s of a collective over ``span`` consecutive ranks (inside a node: NVLink)."""
    cluster = request.cluster
    link = cluster.nvlink_bytes_per_s if span <= cluster.per_node else cluster.network_bytes_per_s
    return link * BUS_SHARE


@dataclass(frozen=True)
class Traffic:
    """One kind of a step's communication on a GPU: the bytes it moves, over how many
    consecutive ranks (beyond a node's GPUs: the network), whether compute hides it (FSDP's and
    HSDP's), and the fixed latency of its calls."""

    kind: str
    nbytes: float
    span: int
    hidden: bool
    fixed_s: float = 0.0


def traffic(request: PlanRequest, layout: Layout, total_params: int) -> list[Traffic]:
    """Every kind of communication of one step on the busiest GPU."""
    cfg, cluster = request.model, request.cluster
    e = request.element_bytes
    m = layout.microbatches
    params = total_params / (layout.tp * layout.pp)
    shards = layout.dp_shard * layout.cp
    local_blocks = cfg.n_layers / layout.pp  # FSDP wraps each block: a collective per block

    def nodes(span: int) -> int:
        return -(-span // cluster.per_node)

    items = []
    if shards > 1:
        span = shards * layout.tp
        gathers = 2 * m if layout.pp == 1 else 1
        share = (shards - 1) / shards * params
        calls = local_blocks * (gathers + 1)  # the all-gathers and one reduce-scatter
        fixed = calls * ring_latency(shards, nodes(span))
        items.append(Traffic("fsdp", share * (gathers * e + 4), span, True, fixed))
        # The step's first all-gather (one block's parameters): nothing runs before it.
        first = share * e / max(1, cfg.n_layers)
        items.append(Traffic("first gather", first, span, False, ring_latency(shards, 1)))
    if layout.dp_replicate > 1:
        r = layout.dp_replicate
        moved = 2 * (r - 1) / r * params / shards * 4
        span = cluster.gpus // layout.pp
        fixed = local_blocks * ring_latency(r, nodes(span), all_reduce=True)
        items.append(Traffic("hsdp", moved, span, True, fixed))
    positions = decoder_positions(cfg, request.frames, request.tokens, layout.tp, layout.cp)
    activation = layout.microbatch * positions * cfg.d_model * e
    blocks = m * local_blocks
    if layout.tp > 1:
        # Sequence parallel: an all-gather and a reduce-scatter around attention and around the
        # FFN, forward and backward.
        per_block = 8 * (layout.tp - 1) / layout.tp * activation / layout.cp
        fixed = 8 * blocks * ring_latency(layout.tp, nodes(layout.tp))
        items.append(Traffic("tp", blocks * per_block, layout.tp, False, fixed))
    if layout.cp > 1:
        kv = cfg.n_kv_heads * llm_head_dim(cfg)
        per_block = 4 * (layout.cp - 1) / layout.cp * activation * kv / cfg.d_model / layout.tp
        span = layout.cp * layout.tp
        fixed = 2 * blocks * ring_latency(layout.cp, nodes(span))
        items.append(Traffic("cp", blocks * per_block, span, False, fixed))
    if layout.ep > 1:
        tokens = activation / layout.cp / layout.tp * cfg.top_k
        per_layer = 4 * (layout.ep - 1) / layout.ep * tokens
        fixed = 4 * blocks * ring_latency(layout.ep, nodes(layout.ep))
        items.append(Traffic("ep", blocks * per_layer, layout.ep, False, fixed))
    if layout.pp > 1:
        hop = activation / layout.cp / layout.tp
        # Neighbouring stages' ranks are a stage apart: across nodes once a stage fills one.
        span = 2 * cluster.gpus // layout.pp
        transfers = pipeline_transfers(layout.pp, m, layout.stages_per_rank)
        items.append(Traffic("pp", transfers * hop, span, False, transfers * P2P_LATENCY_S))
    return items


def seconds_of(request: PlanRequest, item: Traffic) -> float:
    return transfer_seconds(item.nbytes, _bandwidth(request, item.span), item.fixed_s)


def cross_node_bytes(items: list[Traffic], per_node: int) -> float:
    """Bytes a GPU sends across nodes in one step: what the ranking weighs among near ties."""
    return sum(t.nbytes for t in items if t.span > per_node)


def communication(request: PlanRequest, items: list[Traffic]) -> tuple[float, float]:
    """(FSDP/HSDP traffic that compute can hide, communication on the critical path), in
    seconds."""
    hidden = exposed = 0.0
    for item in items:
        if item.hidden:
            hidden += seconds_of(request, item)
        else:
            exposed += seconds_of(request, item)
    return hidden, exposed


def step_time(
    request: PlanRequest,
    layout: Layout,
    total_params: int,
    fsdp: bool,
    parts: tuple[Part, ...] = (),
    items: list[Traffic] | None = None,
) -> dict[str, float]:
    """The step's seconds, and its parts: ``compute`` (each rank's GPU work or host time,
    whichever is longer, at the pipeline's pace, with its bubble), ``exposed_comm``, and the
    busiest rank's kinds of GPU work. ``parts``: each pipeline rank's (LLM blocks, encoder,
    head); empty: one rank holds the whole model. ``items``: the step's ``traffic``, when the
    caller has it."""
    parts = parts or ((request.model.n_layers, True, True),)
    paces: dict[Part, tuple[float, dict[str, float]]] = {}
    for part in set(parts):
        work = gpu_work(request, layout, part)
        work["parameters"] = parameter_work(request, layout, total_params, fsdp)
        gpu = sum(work.values()) / request.constants.step_efficiency
        issue, checkpointing = host_time(request, layout, part)
        paces[part] = (max(gpu, issue) + checkpointing, work)
    busiest, work = max(paces.values(), key=lambda pace: pace[0])
    mean = sum(paces[part][0] for part in parts) / len(parts)
    compute = pipeline_pace(mean, busiest, request.constants)
    compute *= 1 + bubble(layout.pp, layout.microbatches, layout.stages_per_rank)
    if items is None:
        items = traffic(request, layout, total_params)
    hidden, exposed = communication(request, items)
    comm = overlapped_seconds(compute, hidden, request.constants) - compute + exposed
    return {"step": compute + comm, "compute": compute, "exposed_comm": comm, **work}
