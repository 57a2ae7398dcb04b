"""``orchestrator plan``: the ranked layouts for a model, a batch and a cluster."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from contract.gpus import GPU_KEYS, gpu_preset
from orchestrator.errors import UsageError
from orchestrator.planner.activations import Microbatch
from orchestrator.planner.cluster import DEFAULT_INTER_NODE_GBPS, GIB, Cluster
from orchestrator.planner.measured import (
    MEMORY_BOUND,
    SPEED_BOUND,
    TABLE,
    Measurement,
    load,
    parse_layout,
)
from orchestrator.planner.ranking import sweep_figures
from orchestrator.planner.request import Estimate, Layout, PlanRequest, PlanResult
from orchestrator.planner.search import plan, price
from train.models.freeze import frozen_names
from train.models.hf_config import decoder_fields
from train.models.inventory import inventory
from train.models.lora import DEFAULT_ALPHA, DEFAULT_TARGETS, freeze_rules, with_lora
from train.models.presets import PRESETS, get_preset
from train.models.pretrained_parts import ENCODER_PART, LLM_PART, PARTS, part_of, referenced_names
from train.parallel.dims import AC_MODES, DEFAULT_LOSS_CHUNK, DEGREES

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "comm_buffers", "allowance")
SHAPE_FLAGS = {
    # flag: SALMConfig field
    "layers": "n_layers",
    "hidden": "d_model",
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "ffn": "ffn_hidden",
    "vocab": "vocab_size",
    "experts": "n_experts",
    "top_k": "top_k",
    "moe_hidden": "moe_hidden",
    "enc_dim": "enc_dim",
    "enc_layers": "enc_layers",
    "enc_heads": "enc_heads",
    "enc_ffn": "enc_ffn_hidden",
}


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="rank the parallel layouts that fit a model, batch and cluster",
        description="Price every layout (dp_replicate, dp_shard, tp, cp, pp, ep, microbatches, "
        "activation checkpointing) for memory per GPU and step time, and rank those that fit. "
        "docs/planner.md describes the model and its measured errors.",
    )
    parser.add_argument("--model", default="llm_1b", help=f"a named shape: {', '.join(PRESETS)}")
    parser.add_argument(
        "--hf-config",
        metavar="DIR",
        help="the LLM's shape from a Hugging Face model directory's config.json (as "
        "model.pretrained_llm reads it; the encoder stays --model's)",
    )
    parser.add_argument(
        "--freeze",
        action="append",
        default=[],
        metavar="REGEX",
        help="parameters that do not train (model.freeze; repeatable): weights only, no "
        "gradients or optimizer state",
    )
    parser.add_argument(
        "--unfreeze", action="append", default=[], metavar="REGEX", help="model.unfreeze"
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="LoRA adapters of rank R on the LLM (model.lora.rank): the LLM's own weights "
        "frozen, the adapters, encoder and projector trained",
    )
    parser.add_argument(
        "--lora-targets",
        default=",".join(DEFAULT_TARGETS),
        metavar="NAMES",
        help="the adapted projections, comma-separated (model.lora.target_modules; default "
        "%(default)s)",
    )
    shape = parser.add_argument_group("model shape (overrides --model's and --hf-config's)")
    for flag in SHAPE_FLAGS:
        shape.add_argument(f"--{flag.replace('_', '-')}", type=int, dest=flag)
    batch = parser.add_argument_group("batch")
    batch.add_argument("--seconds", type=float, help="audio seconds per sequence (default 30)")
    batch.add_argument("--tokens", type=int, help="transcript tokens per sequence (default 256)")
    batch.add_argument(
        "--seq-len", type=int, help="decoder positions per sequence, text only (no audio)"
    )
    batch.add_argument("--global-batch", type=int, default=256, help="sequences per step")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=int, help="GPUs in all (required, except with --measured)")
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--gpu", default="h100", choices=GPU_KEYS, help="GPU model")
    cluster.add_argument("--gpu-memory-gib", type=float, help="usable memory (default: the GPU's)")
    cluster.add_argument("--intra-node-gbps", type=float, help="GB/s per GPU (default: NVLink/2)")
    cluster.add_argument(
        "--inter-node-gbps",
        type=float,
        default=DEFAULT_INTER_NODE_GBPS,
        help="GB/s per GPU across nodes (default: one 400 Gb/s NIC per GPU)",
    )
    choices = parser.add_argument_group("what may be used")
    choices.add_argument("--no-ac", action="store_true", help="no activation checkpointing")
    choices.add_argument("--no-mixed-precision", action="store_true", help="fp32 compute")
    choices.add_argument(
        "--eager",
        action="store_true",
        help="price eager execution (compile=false; default: compiled)",
    )
    choices.add_argument(
        "--loss-chunk",
        type=int,
        default=DEFAULT_LOSS_CHUNK,
        metavar="N",
        help=f"positions whose logits the loss holds at once (train.loss_chunk, default "
        f"{DEFAULT_LOSS_CHUNK}); 0 prices a loss over the full logits, as torchtitan's",
    )
    choices.add_argument(
        "--llm-only",
        action="store_true",
        help="the LLM alone, without the audio encoder and projector (text-only training, as "
        "published LLM benchmarks run; needs --seq-len)",
    )
    choices.add_argument(
        "--layout",
        metavar="SPEC",
        help='price this layout only, e.g. "dp_shard=4 tp=2 microbatches=1 ac=selective" '
        "(degrees left out are 1; microbatch size: what the global batch leaves)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--top", type=int, default=5, help="feasible layouts shown (default 5)")
    output.add_argument("--all", action="store_true", help="also the layouts that do not fit")
    output.add_argument("--json", action="store_true")
    output.add_argument(
        "--measured",
        nargs="?",
        const=str(TABLE),
        metavar="CSV",
        help="instead of planning: price every row of a table of measured runs (default: the "
        "published measurements and ours, orchestrator/planner/measurements.csv) and print "
        "predicted against measured tokens/s per GPU and peak memory",
    )


def request_from(args: argparse.Namespace) -> PlanRequest:
    if args.gpus is None:
        raise UsageError("orchestrator plan: --gpus is required")
    if args.loss_chunk < 0:
        raise UsageError(f"--loss-chunk {args.loss_chunk}: give positions per chunk, or 0")
    try:
        shape = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items()}
        model = get_preset(args.model)
        if args.hf_config:
            model = replace(model, **decoder_fields(args.hf_config, "--hf-config"))
        model = replace(model, **{key: value for key, value in shape.items() if value is not None})
        targets = [name for name in args.lora_targets.split(",") if name]
        model = with_lora(model, args.lora_rank, DEFAULT_ALPHA, 0.0, targets)
        names = [tensor.name for tensor in inventory(model)]
        frozen = frozen_names(names, freeze_rules(args.freeze, args.lora_rank), args.unfreeze)
        # What checkpoints leave to the pretrained files (checkpoint.by_reference's default).
        pretrained = {LLM_PART} if args.hf_config else set()
        pretrained |= {ENCODER_PART} if model.encoder_dir else set()
        referenced = referenced_names(frozen, pretrained)
        gpu = gpu_preset(args.gpu)
        cluster = Cluster(
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            gpu=gpu,
            memory_gib=args.gpu_memory_gib,
            inter_node_gbps=args.inter_node_gbps,
            intra_node_gbps=args.intra_node_gbps,
        )
    except ValueError as error:
        raise UsageError(str(error)) from error
    if args.seq_len is not None and (args.seconds is not None or args.tokens is not None):
        raise UsageError("--seq-len is a text-only sequence: give it, or --seconds/--tokens")
    seconds = 0.0 if args.seq_len is not None else (30.0 if args.seconds is None else args.seconds)
    tokens = args.seq_len if args.seq_len is not None else (args.tokens or 256)
    if seconds < 0 or tokens < 1 or args.global_batch < 1:
        raise UsageError("--seconds must be >= 0, --tokens/--seq-len and --global-batch >= 1")
    if args.llm_only and args.seq_len is None:
        raise UsageError("--llm-only prices text-only sequences: give --seq-len")
    return PlanRequest(
        model=model,
        seconds=seconds,
        tokens=tokens,
        global_batch=args.global_batch,
        cluster=cluster,
        ac_modes=("none",) if args.no_ac else AC_MODES,
        mixed_precision=not args.no_mixed_precision,
        frozen=frozenset(frozen),
        referenced=frozenset(referenced),
        compiled=not args.eager,
        llm_only=args.llm_only,
        loss_chunk=args.loss_chunk,
    )


def layout_from(spec: str, request: PlanRequest) -> Layout:
    """``--layout``'s layout; its microbatch size is what the global batch leaves."""
    try:
        fields = parse_layout(spec)
    except ValueError as error:
        raise UsageError(f"--layout: {error}") from error
    degrees = {key: int(fields[key]) for key in DEGREES}
    microbatches = int(fields["microbatches"])
    if fields["ac"] not in AC_MODES:
        raise UsageError(f"--layout: ac={fields['ac']} is not one of {', '.join(AC_MODES)}")
    world = 1
    for degree in degrees.values():
        world *= degree if degree > 0 else 1
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    per_rank, left = divmod(request.global_batch, dp * microbatches)
    if left or per_rank < 1:
        raise UsageError(
            f"--layout: --global-batch {request.global_batch} is not a multiple of {dp} "
            f"data-parallel ranks x {microbatches} microbatches"
        )
    return Layout(**degrees, microbatch=per_rank, microbatches=microbatches, ac=str(fields["ac"]))


def estimate_json(result: Estimate, seconds: float) -> dict:
    layout = result.layout
    return {
        "layout": {
            **layout.degrees(),
            "microbatch": layout.microbatch,
            "microbatches": layout.microbatches,
            "ac": layout.ac,
        },
        "fits": result.fits,
        "memory_gib": {kind: value / GIB for kind, value in result.memory.items()},
        "step_time_s": result.step_time_s,
        "exposed_comm_s": result.times.get("exposed_comm"),
        "mfu": result.mfu,
        "reasoning": result.reasoning,
        "reason": result.reason or None,
        "overrides": layout.overrides(seconds),
    }


def result_json(result: PlanResult, shown: list[Estimate], elapsed: float) -> dict:
    request = result.request
    best = result.best
    return {
        "parameters": result.params,
        "trainable_parameters": result.trainable,
        "gpus": request.cluster.gpus,
        "gpu": request.cluster.gpu.key,
        "memory_per_gpu_gib": request.cluster.memory_bytes / GIB,
        "fits_one_gpu": result.fits_one_gpu,
        "checkpoint_bytes": result.checkpoint_bytes,
        "layouts_priced": len(result.estimates),
        "feasible": len(result.feasible),
        "best": None if best is None else estimate_json(best, request.seconds),
        "layouts": [estimate_json(item, request.seconds) for item in shown],
        "yaml": recipe_lines(request) if best else None,
        "seconds": elapsed,
    }


def recipe_lines(request: PlanRequest) -> list[str]:
    cluster = request.cluster
    per_node = cluster.per_node
    return [
        "template: distributed",
        f"nodes: {cluster.nodes}",
        f"tasks_per_node: {per_node}",
        f"gpus_per_node: {per_node}",
        f"gpu: {cluster.gpu.key}",
    ]


def checkpoint_line(result: PlanResult) -> str:
    """``a checkpoint: 0.02 GiB (what trains, with its Adam moments; the frozen pretrained
    LLM by reference)``."""
    request = result.request
    parts = sorted({PARTS[part] for part in map(part_of, request.referenced) if part})
    held = f"; the frozen pretrained {' and '.join(parts)} by reference" if parts else ""
    return (
        f"a checkpoint: {result.checkpoint_bytes / GIB:.2f} GiB (weights, with Adam's moments "
        f"for what trains{held})"
    )


def print_result(result: PlanResult, shown: list[Estimate], elapsed: float) -> None:
    request = result.request
    cluster = request.cluster
    frozen = result.params - result.trainable
    training = f" ({result.trainable / 1e9:.2f}B train, the rest frozen)" if frozen else ""
    print(
        f"{result.params / 1e9:.2f}B parameters{training}; {cluster.gpus} x {cluster.gpu.key} "
        f"({cluster.nodes} node(s) of {cluster.per_node}, {cluster.memory_bytes / GIB:.0f} GiB "
        f"each); {request.global_batch} sequences of {request.seconds:g} s audio + "
        f"{request.tokens} tokens per step"
    )
    print(checkpoint_line(result))
    print(
        f"{len(result.estimates)} layouts priced in {elapsed * 1000:.0f} ms, "
        f"{len(result.feasible)} fit"
    )
    header = ["#", "layout", "GiB/GPU", "params", "grads", "optim", "act", "comm", "step s", "MFU"]
    rows = []
    for rank, item in enumerate(shown, 1):
        memory = item.memory
        rows.append(
            [
                str(rank) if item.fits else "-",
                item.layout.describe(),
                f"{memory['total'] / GIB:.1f}",
                *(f"{memory[kind] / GIB:.1f}" for kind in MEMORY_KINDS[:5]),
                f"{item.step_time_s:.2f}",
                f"{100 * item.mfu:.0f}%",
            ]
        )
    widths = [max(len(row[col]) for row in [header, *rows]) for col in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    for item in shown:
        if not item.fits:
            print(f"  does not fit: {item.layout.describe()}: {item.reason}")
    best = result.best
    if best is None:
        return
    print(f"best: {best.reasoning}")
    print("as Hydra overrides:")
    print("  " + " ".join(best.layout.overrides(request.seconds)))
    print("as a YAML recipe:")
    for line in recipe_lines(request):
        print(f"  {line}")


def cmd_plan(args: argparse.Namespace) -> int:
    if args.measured is not None:
        return print_measured(Path(args.measured))
    request = request_from(args)
    if args.layout:
        try:
            result = price(request, layout_from(args.layout, request))
        except ValueError as error:
            raise UsageError(f"--layout: {error}") from error
        if args.json:
            print(json.dumps(result_json(result, result.estimates, 0.0)))
        else:
            print_result(result, result.estimates, 0.0)
        check_fits(result)
        return 0
    started = time.perf_counter()
    result = plan(request)
    elapsed = time.perf_counter() - started
    shown = result.feasible[: max(0, args.top)]
    if args.all:
        shown += [item for item in result.estimates if not item.fits]
    if args.json:
        print(json.dumps(result_json(result, shown, elapsed)))
    else:
        print_result(result, shown, elapsed)
    check_fits(result)
    return 0


def check_fits(result: PlanResult) -> None:
    """No layout fits: a request nothing can serve is bad input (exit 2), said on one line with
    why the leanest layout does not fit, after the table (or JSON) that shows them all."""
    if result.best is not None:
        return
    cluster = result.request.cluster
    what = f"{cluster.gpus} x {cluster.gpu.key} ({cluster.memory_bytes / GIB:.0f} GiB each)"
    if not result.estimates:
        raise UsageError(f"no layout of the model runs on {what}; try another number of GPUs")
    leanest = result.estimates[0]  # those that do not fit come leanest first
    which = "the leanest, " if len(result.estimates) > 1 else ""
    raise UsageError(
        f"no layout fits {what}: {which}{leanest.layout.describe()}, {leanest.reason}; use "
        "more GPUs, a GPU with more memory, or a smaller batch"
    )


@dataclass(frozen=True)
class Prediction:
    """The planner's figures for one measured row."""

    row: Measurement
    tokens_per_s: float  # per GPU
    memory_gib: float  # the busiest rank's total
    estimate: Estimate

    @property
    def speed_error(self) -> float:
        return self.tokens_per_s / self.row.tokens_per_s_per_gpu - 1

    @property
    def memory_error(self) -> float:
        if self.row.peak_memory_gib is None:
            return 0.0
        return self.memory_gib / self.row.peak_memory_gib - 1


def price_row(row: Measurement) -> Prediction:
    """The planner's figures for a measured configuration: its plan arguments and layout."""
    parser = argparse.ArgumentParser(prog="orchestrator", exit_on_error=False)
    add_plan_parser(parser.add_subparsers())
    try:
        args = parser.parse_args(["plan", *row.plan_args])
    except (argparse.ArgumentError, SystemExit) as error:
        raise UsageError(f"measurement {row.plan!r}: not orchestrator plan's arguments") from error
    request = request_from(args)
    result = price(request, layout_from(row.layout, request))
    item = result.estimates[0]
    batch = Microbatch(1, request.frames, request.tokens)
    positions = batch.decoder_positions(request.model, 1)
    tokens_per_s = request.global_batch * positions / item.step_time_s / request.cluster.gpus
    return Prediction(row, tokens_per_s, item.memory["total"] / GIB, item)


def print_measured(path: Path) -> int:
    """Predicted against measured, one markdown row per measurement, then each sweep's ranking
    figures (orchestrator/planner/ranking.py); 1 when a priced row the constants were fitted
    to is outside the bounds (held-out rows are reported, not bounded)."""
    try:
        rows = load(path)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"--measured {path}: {error}") from error
    print(
        "| source | configuration | layout | measured tok/s/GPU | predicted | error "
        "| measured GiB | predicted | error |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    outside = 0
    sweeps: dict[str, list[Prediction]] = {}
    for row in rows:
        if not row.priced:
            print(
                f"| {row.source} | `{row.plan}` | {row.layout} | {row.tokens_per_s_per_gpu:,.0f} "
                f"| {row.scope} | | {row.peak_memory_gib or ''} | | |"
            )
            continue
        p = price_row(row)
        if row.sweep:
            sweeps.setdefault(row.sweep, []).append(p)
        memory = "| |"
        if row.peak_memory_gib is not None:
            memory = f"| {p.memory_gib:.1f} | {p.memory_error:+.1%} |"
            outside += not row.held_out and abs(p.memory_error) > MEMORY_BOUND
        outside += not row.held_out and abs(p.speed_error) > SPEED_BOUND
        print(
            f"| {row.source} | `{row.plan}` | {row.layout} | {row.tokens_per_s_per_gpu:,.0f} "
            f"| {p.tokens_per_s:,.0f} | {p.speed_error:+.1%} | {row.peak_memory_gib or ''} {memory}"
        )
    bounds = f"{SPEED_BOUND:.0%} on speed, {MEMORY_BOUND:.0%} on memory"
    print(f"{outside} figure(s) outside the bounds ({bounds}; held-out rows are not bounded)")
    if sweeps:
        print()
        print("| sweep | part | layouts | rank correlation | first choice / best | worst error |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for name, priced in sweeps.items():
            if len(priced) < 2:
                continue  # one layout: nothing to rank
            figures = sweep_figures(
                name,
                priced[0].row.held_out,
                [p.row.tokens_per_s_per_gpu for p in priced],
                [p.tokens_per_s for p in priced],
            )
            print(figures.line())
    return 1 if outside else 0
