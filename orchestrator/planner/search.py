"""Choosing a parallel layout: every valid layout priced for memory and step time, then ranked.

Memory per GPU (the busiest rank, pipeline stage 0 unless a later stage holds more):
parameters, gradients and optimizer states exactly as the trainer allocates them
(``planner.state``); activations by formula (``planner.activations``); communication buffers
(FSDP2's gathered bf16 parameters of the two largest blocks, current and prefetched, and one
block's fp32 gradients before their reduce-scatter; a pipeline stage keeps all its parameters
gathered from forward to backward; DDP's gradient buckets); and an allowance for the framework
(CUDA context, NCCL communicators, workspaces: 1.5 GiB) plus 5% of the rest for allocator
fragmentation.

Step time: ``planner.speed`` (each kind of work at the rate a GPU reaches for it, host time
in eager, communication that compute does not hide, the pipeline bubble). MFU is the model
FLOPs over step time x GPUs x peak.

Ranking follows the estimated step time. Among the layouts within ``NEAR_TIE`` of the fastest,
the flowchart of the parallelism guide decides, so that a simpler layout wins what the model
cannot tell apart: data parallelism alone (FSDP2, HSDP across nodes) when it fits; else TP
inside the node first; PP across nodes once TP fills a node; CP for long sequences
(``LONG_SEQUENCE`` decoder positions or more); then the fewest bytes across nodes (the network
is the part of a cluster that varies most from the model's figures), then speed.
"""

from __future__ import annotations

import math
from functools import cache

from orchestrator.planner.activations import (
    ActivationLayout,
    ActivationTerms,
    Microbatch,
    activation_bytes,
    activation_terms,
    in_flight,
)
from orchestrator.planner.cluster import GIB
from orchestrator.planner.request import Estimate, Layout, PlanRequest, PlanResult
from orchestrator.planner.speed import Part, cross_node_bytes, step_time, traffic
from orchestrator.planner.state import (
    GroupedInventory,
    checkpoint_bytes,
    group,
    held,
    state_bytes,
    uses_fsdp,
)
from train.flops import sequence_flops
from train.models.inventory import inventory, stage_param_counts
from train.models.shape import SALMConfig
from train.parallel.dims import sequence_multiple
from train.parallel.pipeline_plan import PipelinePlan, plan_pipeline

FRAMEWORK_BYTES = 1.5 * GIB  # CUDA context, communicators, workspaces
HOST_FRAMEWORK_BYTES = 0.5 * GIB  # a CPU rank's Python, torch and gloo
FRAGMENTATION = 0.05  # of everything else, for the caching allocator
LONG_SEQUENCE = 32768  # decoder positions from which CP is the flowchart's answer
NEAR_TIE = 0.05  # step times within 5% of the fastest: the flowchart chooses among them
FULL_STATE_BYTES = 16  # fp32 weight + gradient + two Adam moments per parameter
WEIGHT_BYTES = 4  # the fp32 weight alone (a frozen parameter)
AUDIO_PREFIXES = ("encoder.", "projector.")  # what --llm-only leaves out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(request: PlanRequest) -> list[Layout]:
    """Every layout the trainer can run on the cluster, with TP inside a node and pipeline
    stages of whole nodes."""
    cfg, cluster = request.model, request.cluster
    gpus, per_node = cluster.gpus, cluster.per_node
    tps = [t for t in divisors(per_node) if cfg.n_heads % t == 0 and cfg.n_kv_heads % t == 0]
    pps = [p for p in divisors(cluster.nodes) if p <= cfg.n_layers]
    layouts = []
    for tp in tps:
        for pp in pps:
            for cp in (c for c in (1, 2, 4, 8, 16) if gpus % (tp * pp * c) == 0):
                dp = gpus // (tp * pp * cp)
                if request.global_batch % dp:
                    continue
                per_rank = request.global_batch // dp
                node_share = max(1, per_node // (tp * cp))
                splits = {(1, dp)}
                if dp % node_share == 0 and node_share < dp:
                    splits.add((dp // node_share, node_share))  # HSDP: shard inside a node
                for replicate, shard in sorted(splits):
                    experts = cfg.n_experts or 1
                    ranks = shard * cp * tp
                    for ep in (e for e in divisors(experts) if ranks % e == 0):
                        for microbatch in divisors(per_rank):
                            m = per_rank // microbatch
                            if pp > 1 and m < pp:
                                continue
                            for ac in request.ac_modes:
                                layouts.append(
                                    Layout(
                                        microbatch,
                                        m,
                                        ac,
                                        dp_replicate=replicate,
                                        dp_shard=shard,
                                        tp=tp,
                                        cp=cp,
                                        pp=pp,
                                        ep=ep,
                                    )
                                )
    return layouts


def pipeline_for(counts: tuple, layout: Layout, cache: dict) -> PipelinePlan | None:
    """The trainer's plan for ``layout`` (``train.parallel.pipeline_plan``: its schedule, stages per
    rank and split; a balanced split is computed once per pp, schedule and stages per rank, and a
    plan once per its settings)."""
    if layout.pp == 1:
        return None
    blocks, first, last, _ = counts
    key = ("split", layout.pp, layout.schedule, layout.stages_per_rank)
    if not layout.pp_split and key not in cache:
        cache[key] = plan_pipeline(
            layout.pp, layout.schedule, layout.pp, layout.stages_per_rank, [], blocks, first, last
        ).split
    split = layout.pp_split or cache[key]
    key = ("plan", layout.pp, layout.schedule, layout.microbatches, layout.stages_per_rank, split)
    if key not in cache:
        cache[key] = plan_pipeline(
            layout.pp,
            layout.schedule,
            layout.microbatches,
            layout.stages_per_rank,
            split,
            blocks,
            first,
            last,
        )
    return cache[key]


def comm_buffer_bytes(
    request: PlanRequest,
    inventory: GroupedInventory,
    layout: Layout,
    plan: PipelinePlan | None,
    fsdp: bool,
) -> float:
    """Gathered parameters and unreduced gradients FSDP2 (or DDP) keeps around compute."""
    e = request.element_bytes
    stage = sum(t.numel * n for t, n, _ in held(inventory, plan, 0))
    if not fsdp:
        return stage * 4.0 if layout.dp > 1 else 0.0  # DDP's gradient buckets
    block = inventory.block_numel / layout.tp
    if request.model.n_experts and layout.ep > 1:
        experts = max(
            sum(t.numel * n for t, n, _ in run.tensors if t.expert) for run in inventory.runs
        )
        experts /= layout.tp
        block -= experts * (1 - 1 / layout.ep)
    if plan is not None:  # a stage keeps its parameters gathered for all its microbatches
        return stage / layout.tp * e + block * 4
    return 2 * block * e + block * 4


def pipeline_parts(cfg: SALMConfig, plan: PipelinePlan | None, pp: int) -> tuple[Part, ...]:
    """Each pipeline rank's part: its LLM blocks, whether it has the encoder, whether the head."""
    if plan is None:
        return ((cfg.n_layers, True, True),)
    parts = []
    for rank in range(pp):
        stages = plan.local_stages(rank)
        blocks = sum(plan.split[stage] for stage in stages)
        parts.append((blocks, 0 in stages, plan.num_stages - 1 in stages))
    return tuple(parts)


def rank_parts(
    cfg: SALMConfig, plan: PipelinePlan | None, layout: ActivationLayout, cache: dict
) -> list[tuple[Part, float]]:
    """Per pipeline rank: its part and the microbatches it holds in flight; once per pipeline
    plan."""
    if plan is None:
        return [(pipeline_parts(cfg, plan, 1)[0], 1.0)]
    key = ("parts", plan)
    if key not in cache:
        parts = pipeline_parts(cfg, plan, layout.pp)
        cache[key] = [(part, in_flight(layout, rank)) for rank, part in enumerate(parts)]
    return cache[key]


def timing_inputs(request: PlanRequest, layout: Layout) -> tuple[int, bool, tuple[Part, ...]]:
    """What ``step_time`` reads beyond the request and the layout (the parameter count, whether
    FSDP runs, each pipeline rank's part), for pricing one layout's time again and again."""
    counts = priced_inventory(request)[1]
    plan = pipeline_for(counts, layout, {})
    bf16 = request.mixed_precision and request.on_gpu
    fsdp = uses_fsdp(layout.dims(request.cluster.gpus), request.strategy, bf16)
    return counts[3], fsdp, pipeline_parts(request.model, plan, layout.pp)


def estimate(
    request: PlanRequest,
    layout: Layout,
    inventory: GroupedInventory,
    counts: tuple,
    state_cache: dict,
) -> Estimate:
    cfg, cluster = request.model, request.cluster
    gpus = cluster.gpus
    dims = layout.dims(gpus)
    plan = pipeline_for(counts, layout, state_cache)
    key = tuple(layout.degrees().values())
    bf16 = request.mixed_precision and request.on_gpu
    fsdp = uses_fsdp(dims, request.strategy, bf16)
    if key not in state_cache:
        ranks = range(layout.pp)
        states = [
            state_bytes(inventory, dims, plan, request.strategy, bf16, cfg.n_experts, rank)
            for rank in ranks
        ]
        state_cache[key] = (states, comm_buffer_bytes(request, inventory, layout, plan, fsdp))
    states, comm = state_cache[key]
    batch = Microbatch(layout.microbatch, request.frames, request.tokens)
    act_layout = ActivationLayout(
        **layout.degrees(),
        stages_per_rank=1 if plan is None else plan.stages_per_rank,
        schedule=layout.schedule,
        microbatches=layout.microbatches,
        ac=layout.ac,
        element_bytes=request.element_bytes,
        loss_chunk=request.loss_chunk,
    )
    # A rank's terms depend on its part and on what activation_terms reads of the layout; layouts
    # that differ only in dp, ep or the pipeline's schedule share them.
    shape = (batch, layout.tp, layout.cp, layout.pp > 1, layout.ac, request.element_bytes)
    allowance = framework_bytes(request)
    worst_total, worst = -1.0, (states[0], 0.0)
    parts = rank_parts(cfg, plan, act_layout, state_cache)
    terms: dict[tuple, ActivationTerms] = {}  # this layout's, by part
    for state, (part, in_flight_now) in zip(states, parts, strict=True):
        if part not in terms:
            terms_key = ("terms", part, *shape)
            if terms_key not in state_cache:
                state_cache[terms_key] = activation_terms(cfg, batch, act_layout, part)
            terms[part] = state_cache[terms_key]
        act = terms[part].peak(in_flight_now)
        subtotal = state.params + state.grads + state.optimizer + act + comm
        total = subtotal * (1 + FRAGMENTATION) + allowance
        if total > worst_total:
            worst_total, worst = total, (state, act)
    state, act = worst
    memory = {
        "params": state.params,
        "grads": state.grads,
        "optimizer": state.optimizer,
        "activations": act,
        "comm_buffers": comm,
    }
    subtotal = sum(memory.values())
    memory["allowance"] = allowance + FRAGMENTATION * subtotal
    memory["total"] = subtotal + memory["allowance"]
    worst = memory
    fits = worst["total"] <= cluster.memory_bytes
    items = traffic(request, layout, counts[3])
    times = step_time(request, layout, counts[3], fsdp, tuple(part for part, _ in parts), items)
    flops = request.global_batch * _sequence_flops(cfg, request.frames, request.tokens)
    mfu = flops / (times["step"] * gpus * cluster.gpu.peak_bf16_flops)
    reason = ""
    if not fits:
        reason = (
            f"needs {worst['total'] / GIB:.1f} GiB per GPU, more than "
            f"{cluster.memory_bytes / GIB:.0f} GiB"
        )
    across = cross_node_bytes(items, cluster.per_node)
    return Estimate(layout, worst, fits, times["step"], mfu, "", 0, reason, times, across)


@cache
def _sequence_flops(cfg: SALMConfig, frames: int, tokens: int) -> float:
    return sequence_flops(cfg, frames, tokens)


def framework_bytes(request: PlanRequest) -> float:
    return FRAMEWORK_BYTES if request.on_gpu else HOST_FRAMEWORK_BYTES


def full_state_fits(request: PlanRequest, params: int, trainable: int) -> tuple[bool, float]:
    """Whether the whole training state and one sequence's activations fit one GPU (frozen
    parameters: their weights only)."""
    one = Microbatch(1, request.frames, request.tokens)
    ac = request.ac_modes[-1]
    act_layout = ActivationLayout(
        ac=ac, element_bytes=request.element_bytes, loss_chunk=request.loss_chunk
    )
    act = activation_bytes(request.model, one, act_layout).peak
    needed = WEIGHT_BYTES * params + (FULL_STATE_BYTES - WEIGHT_BYTES) * trainable + act
    needed += framework_bytes(request) + FRAGMENTATION * needed
    return needed <= request.cluster.memory_bytes, needed


def flowchart(request: PlanRequest, layout: Layout, dp_fits: bool, max_tp: int) -> int:
    """How many of the guide's rules ``layout`` breaks (``dp_fits``: a layout of data
    parallelism alone fits)."""
    batch = Microbatch(1, request.frames, request.tokens)
    long = (
        batch.decoder_positions(request.model, sequence_multiple(layout.tp, layout.cp))
        >= LONG_SEQUENCE
    )
    broken = 0
    if dp_fits:
        broken += (layout.tp > 1) + (layout.pp > 1)
    elif layout.tp == 1 and max_tp > 1:
        broken += 1
    if layout.pp > 1 and layout.tp < max_tp:
        broken += 1
    if layout.cp > 1 and not long:
        broken += 1
    return broken


def _data_parallel_clause(layout: Layout, fits_one_gpu: bool, dp_best: float | None) -> str:
    if dp_best is None:
        return "; data parallelism alone does not fit"
    if math.isnan(dp_best):
        return ""
    if max(layout.tp, layout.pp, layout.cp) > 1:
        return f"; data parallelism alone fits but is slower ({dp_best:.2f} s per step)"
    return "" if fits_one_gpu else "; data parallelism alone fits"


def reasoning(
    request: PlanRequest, layout: Layout, params: int, needed: float, dp_best: float | None
) -> str:
    """One line: which branch of the flowchart ``layout`` takes, and why (``dp_best``: the
    fastest layout of data parallelism alone, None when none fits, NaN when ``layout`` was
    priced alone)."""
    cluster = request.cluster
    gib = cluster.memory_bytes / GIB
    fits = needed <= cluster.memory_bytes
    one = "fits one GPU" if fits else f"does not fit one GPU ({gib:.0f} GiB)"
    one += _data_parallel_clause(layout, fits, dp_best)
    parts = [
        f"model needs {needed / GIB:.0f} GiB for {params / 1e9:.2f}B parameters with fp32 "
        f"gradients and Adam states and one sequence's activations: {one}"
    ]
    if layout.tp > 1:
        parts.append(f"TP={layout.tp} inside the node")
    if layout.pp > 1:
        parts.append(
            f"PP={layout.pp} across {cluster.nodes} nodes ({layout.microbatches} microbatches)"
        )
    if layout.cp > 1:
        batch = Microbatch(1, request.frames, request.tokens)
        positions = batch.decoder_positions(request.model, sequence_multiple(layout.tp, layout.cp))
        parts.append(f"CP={layout.cp} for {positions}-position sequences")
    if layout.ep > 1:
        parts.append(f"EP={layout.ep} for the {request.model.n_experts} experts")
    if layout.dp > 1:
        dp = "HSDP" if layout.dp_replicate > 1 else "FSDP"
        parts.append(f"{dp} over the remaining {layout.dp} data-parallel ranks")
    else:
        parts.append("no data parallelism left (dp=1)")
    if layout.ac != "none":
        parts.append(f"{layout.ac} activation checkpointing")
    return "; ".join(parts)


def priced_inventory(request: PlanRequest) -> tuple[GroupedInventory, tuple, int]:
    """The model's grouped parameters, what the pipeline split weighs (per-block counts, the
    first and last stages' extras, the total) and the bytes of one checkpoint."""
    cfg = request.model
    tensors = inventory(cfg)
    if request.llm_only:
        tensors = [t for t in tensors if not t.name.startswith(AUDIO_PREFIXES)]
    grouped = group(tensors, request.frozen)
    saved = checkpoint_bytes(tensors, request.frozen, request.referenced)
    return grouped, (*stage_param_counts(tensors, cfg.n_layers), grouped.numel), saved


def price(request: PlanRequest, layout: Layout) -> PlanResult:
    """One given layout, priced (ValueError when the trainer cannot run it)."""
    layout.dims(request.cluster.gpus).validate(request.model)
    if request.global_batch % (layout.dp * layout.microbatch * layout.microbatches):
        raise ValueError(
            f"{layout.describe()}: the global batch of {request.global_batch} is not "
            f"{layout.dp} data-parallel ranks x {layout.microbatches} microbatches of "
            f"{layout.microbatch}"
        )
    grouped, counts, saved = priced_inventory(request)
    fits_one, needed = full_state_fits(request, grouped.numel, grouped.trainable_numel)
    result = estimate(request, layout, grouped, counts, {})
    result.reasoning = reasoning(request, layout, grouped.numel, needed, math.nan)
    trainable = grouped.trainable_numel
    return PlanResult(request, grouped.numel, trainable, [result], fits_one, needed, saved)


def plan(request: PlanRequest) -> PlanResult:
    """Every layout, priced; feasible ones first, fastest first (the flowchart's order among
    near ties), then those that do not fit."""
    cfg = request.model
    grouped, counts, saved = priced_inventory(request)
    params = grouped.numel
    fits_one, needed = full_state_fits(request, params, grouped.trainable_numel)
    layouts = candidate_layouts(request)
    max_tp = max((layout.tp for layout in layouts), default=1)
    cache: dict = {}
    estimates = []
    for layout in layouts:
        try:
            layout.dims(request.cluster.gpus).validate(cfg)
        except ValueError:
            continue
        estimates.append(estimate(request, layout, grouped, counts, cache))
    dp_times = [
        e.step_time_s
        for e in estimates
        if e.fits and e.layout.tp == e.layout.pp == e.layout.cp == 1
    ]
    dp_fits = bool(dp_times)
    for result in estimates:
        result.penalty = flowchart(request, result.layout, dp_fits, max_tp)
    fastest = min((e.step_time_s for e in estimates if e.fits), default=0.0)

    def order(e: Estimate) -> tuple:
        if not e.fits:
            return (True, False, 0, e.memory["total"])
        near = e.step_time_s <= fastest * (1 + NEAR_TIE)
        if not near:
            return (False, True, 0, 0.0, e.step_time_s)
        return (False, False, e.penalty, e.cross_node_bytes, e.step_time_s)

    estimates.sort(key=order)
    for result in estimates:
        result.reasoning = reasoning(
            request, result.layout, params, needed, min(dp_times) if dp_times else None
        )
    trainable = grouped.trainable_numel
    return PlanResult(request, params, trainable, estimates, fits_one, needed, saved)
