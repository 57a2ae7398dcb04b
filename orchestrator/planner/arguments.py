"""``orchestrator plan``'s arguments: the parser, and the request and layout they describe.
Shared by the command (``planner.cli``) and the pricing of measured rows (``planner.fit``),
whose ``plan`` column holds the same arguments."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from contract.gpus import GPU_KEYS, gpu_preset
from orchestrator.errors import UsageError
from orchestrator.planner.cluster import DEFAULT_INTER_NODE_GBPS, Cluster
from orchestrator.planner.measured import TABLE, parse_layout
from orchestrator.planner.request import Layout, PlanRequest
from train.models.freeze import frozen_names
from train.models.hf_config import decoder_fields
from train.models.inventory import inventory
from train.models.lora import DEFAULT_ALPHA, DEFAULT_TARGETS, freeze_rules, with_lora
from train.models.presets import PRESETS, get_preset
from train.models.pretrained_parts import ENCODER_PART, LLM_PART, referenced_names
from train.parallel.dims import AC_MODES, DEFAULT_LOSS_CHUNK, DEGREES

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
    choices.add_argument(
        "--calibrate",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="correct the step-time constants for your cluster with your own measured steps: "
        "a chain's run dir (its jobs' metrics.jsonl) or a table in measurements.csv's columns "
        "(bench/gpu_check.sh writes one); repeatable",
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
