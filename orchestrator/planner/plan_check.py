"""The plan check: the planner run before anything is queued, to refuse a training layout that
cannot fit the memory of the machines it asks for.

``auto_launch`` of a YAML recipe whose command runs the trainer (``python -m train ...``) and
each member of a chained sweep compose the trainer's config, price its layout with the planner
and compare the busiest rank's estimate with the memory one rank has:

- a GPU recipe: the GPU's memory, from the recipe's ``gpu`` field (a key of the planner's GPU
  table) or else from the partition's GPU type in sinfo (``gpu:h100:8``); when neither names a
  known GPU the check is skipped with one line saying so;
- a CPU recipe: the node's memory (sinfo's RealMemory; the loopback cluster sets none, so this
  machine's memory) over the ranks per node; the local backend uses this machine's memory.

The batch the planner prices is the trainer's: ``data.max_duration`` seconds of audio per
data-parallel rank and batch (cut into the pipeline's microbatches under PP), taken as one
sequence of that length with ``TOKENS_PER_SECOND`` transcript tokens per second (the byte
tokenizer on read speech runs at about 15). Exceeding the memory exits 2 with one line that
names the estimate, the memory and the best layout that fits; ``--no-plan-check`` (auto_launch)
or ``hydra.launcher.plan_check=false`` (sweeps) skips the check.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from contract.configs import PACKAGED_CONFIG_MODULE, TRAIN_CONFIG, TRAIN_MODULE
from contract.gpus import GPU, gpu_preset
from orchestrator.errors import UsageError
from orchestrator.planner.cluster import GIB, Cluster
from orchestrator.planner.request import Estimate, Layout, PlanRequest
from orchestrator.planner.search import plan, price
from orchestrator.slurm.partitions import Partition

if TYPE_CHECKING:
    from orchestrator.slurm.resources import JobResources
    from train.config import TrainConfig

TOKENS_PER_SECOND = 20
UNSET_REAL_MEMORY_MB = 1  # SLURM's default RealMemory: the node's memory is not configured


@dataclass(frozen=True)
class Capacity:
    """The memory one rank may use, and where that figure comes from (for the error line)."""

    bytes_per_rank: float
    where: str
    gpu: GPU | None  # None: a CPU recipe


def gpu_from_gres(gres_type: str | None) -> GPU | None:
    if not gres_type:
        return None
    try:
        return gpu_preset(gres_type)
    except ValueError:
        return None


def capacity_for(
    gpus_per_node: int,
    tasks_per_node: int,
    gpu_key: str | None,
    partition: Partition | None,
) -> Capacity | None:
    """What one rank has; None when a GPU recipe's GPU is unknown (the check is skipped)."""
    if gpus_per_node > 0:
        if gpu_key:
            gpu = gpu_preset(gpu_key)
            return Capacity(gpu.memory_gib * GIB, f"the {gpu.key} GPU (recipe field gpu)", gpu)
        gpu = gpu_from_gres(partition.gpu_type if partition else None)
        if gpu is None:
            return None
        where = f"the {gpu.key} GPU (partition {partition.name}, sinfo)"
        return Capacity(gpu.memory_gib * GIB, where, gpu)
    if partition is not None and partition.memory_mb > UNSET_REAL_MEMORY_MB:
        node, source = partition.memory_mb * 2**20, f"partition {partition.name}'s nodes"
    else:
        node, source = psutil.virtual_memory().total, "this machine"
    share = node / tasks_per_node
    return Capacity(
        share, f"host memory ({node / GIB:.1f} GiB of {source} over {tasks_per_node} rank(s))", None
    )


def request_and_layout(
    cfg: TrainConfig, nodes: int, tasks_per_node: int, capacity: Capacity
) -> tuple[PlanRequest, Layout]:
    """The planner's view of a trainer config on ``nodes`` x ``tasks_per_node`` ranks."""
    from train.parallel.layout import (
        frozen_of,
        model_of,
        parallel_dims,
        pipeline_for,
        referenced_of,
    )

    world = nodes * tasks_per_node
    dims = parallel_dims(cfg, world)
    pipeline = pipeline_for(cfg, dims)  # the trainer's own split, schedule and microbatches
    microbatches = cfg.train.grad_accum if pipeline is None else pipeline.microbatches
    seconds = cfg.data.max_duration / (1 if pipeline is None else microbatches)
    layout = Layout(
        **dims.degrees(),
        microbatch=1,
        microbatches=microbatches,
        ac=cfg.activation_checkpointing,
        schedule=cfg.parallel.pp_schedule,
        stages_per_rank=0 if pipeline is None else pipeline.stages_per_rank,
        pp_split=() if pipeline is None else pipeline.split,
    )
    cluster = Cluster(
        gpus=world,
        gpus_per_node=tasks_per_node,
        gpu=capacity.gpu or gpu_preset("h100"),
        memory_gib=capacity.bytes_per_rank / GIB,
    )
    request = PlanRequest(
        model=model_of(cfg.model),
        seconds=seconds,
        tokens=math.ceil(seconds * TOKENS_PER_SECOND),
        global_batch=dims.dp * microbatches,
        cluster=cluster,
        mixed_precision=cfg.mixed_precision,
        on_gpu=capacity.gpu is not None,
        strategy=cfg.strategy,
        frozen=frozenset(frozen_of(cfg)),
        referenced=frozenset(referenced_of(cfg)),
        compiled=cfg.compile,
        loss_chunk=cfg.loss_chunk,
    )
    return request, layout


def check_training_fits(
    cfg: TrainConfig,
    nodes: int,
    tasks_per_node: int,
    capacity: Capacity,
    label: str,
    skip_hint: str = "--no-plan-check",
) -> Estimate:
    """Raise a one-line UsageError when ``cfg``'s layout needs more than ``capacity``."""
    request, layout = request_and_layout(cfg, nodes, tasks_per_node, capacity)
    priced = price(request, layout).estimates[0]
    if priced.fits:
        return priced
    memory = priced.memory
    parts = ", ".join(
        f"{kind} {memory[kind] / GIB:.1f}"
        for kind in ("params", "grads", "optimizer", "activations", "comm_buffers", "allowance")
    )
    better = plan(request).best
    if better is None:
        advice = f"no layout of {request.cluster.gpus} rank(s) fits: ask for more ranks or memory"
    else:
        advice = "the best layout that fits: " + " ".join(
            better.layout.overrides(cfg.data.max_duration)
        )
    raise UsageError(
        f"plan check: {label}'s layout ({layout.describe()}) needs "
        f"{memory['total'] / GIB:.1f} GiB per rank ({parts} GiB), more than the "
        f"{capacity.bytes_per_rank / GIB:.1f} GiB of {capacity.where}; {advice}. Nothing was "
        f"queued; {skip_hint} skips this check"
    )


def announce_skipped(label: str) -> None:
    print(
        f"plan check skipped for {label}: the GPU's memory is unknown; set `gpu:` in the recipe "
        "(orchestrator plan --help lists the GPUs)",
        file=sys.stderr,
        flush=True,
    )


def train_arguments(command: list[str]) -> list[str] | None:
    """What follows ``-m train`` in a recipe's command; None when it does not run the trainer."""
    for index in range(len(command) - 1):
        if command[index] == "-m" and command[index + 1] == TRAIN_MODULE:
            return command[index + 2 :]
    return None


_CHAIN_VALUE = re.compile(r"\$\{[A-Z_]+\}")


def compose_training_config(arguments: list[str]) -> TrainConfig:
    """The trainer's config for ``python -m train ARGUMENTS``, as the trainer composes it
    (the chain's own ``seed=${SEED}``/``run_dir=...`` overrides are left out)."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from omegaconf import OmegaConf

    from train.config import register

    register()
    config_name, config_path, overrides = TRAIN_CONFIG, None, []
    words = iter(arguments)
    for word in words:
        if word in ("--config-name", "-cn"):
            config_name = next(words, config_name)
        elif word in ("--config-path", "-cp"):
            config_path = next(words, None)
        elif word.startswith("--config-name="):
            config_name = word.split("=", 1)[1]
        elif word.startswith("--config-path="):
            config_path = word.split("=", 1)[1]
        elif "=" in word and not _CHAIN_VALUE.search(word):
            overrides.append(word)
    context = (
        initialize_config_dir(config_dir=config_path, version_base=None)
        if config_path
        else initialize_config_module(PACKAGED_CONFIG_MODULE, version_base=None)
    )
    with context:
        composed = compose(config_name=config_name, overrides=overrides)
    return OmegaConf.to_object(composed)


def training_job(command: list[str]) -> Callable[[], TrainConfig] | None:
    """What builds the trainer config a recipe's command runs (None: it does not run the
    trainer); called only by the plan check, so the other checks never pay for composing it."""
    arguments = train_arguments(command)
    if arguments is None:
        return None
    return lambda: compose_training_config(arguments)


def plan_check_job(
    training: Callable[[], TrainConfig],
    resources: JobResources,
    partition: Partition | None,
    name: str,
    skip_hint: str,
) -> bool:
    """The plan check of one training job: its layout fits, and the data it names is there;
    False when the rank's memory is unknown (that part skipped, with one line saying so). A
    config the trainer would refuse (a misspelt override, a layout that cannot be built, a
    missing corpus) is the recipe's or its arguments' error, named so, not the check's."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    from train.config import check_data, composition_problem

    try:
        cfg = training()
    except (CompactHydraException, OmegaConfBaseException, ValueError) as error:
        raise UsageError(f"{name}: the trainer's config: {composition_problem(error)}") from error
    capacity = capacity_for(
        resources.gpus_per_node, resources.tasks_per_node, resources.gpu, partition
    )
    if capacity is None:
        announce_skipped(name)
    else:
        try:
            check_training_fits(
                cfg, resources.nodes, resources.tasks_per_node, capacity, name, skip_hint
            )
        except ValueError as error:  # the trainer's ConfigError included
            raise UsageError(f"{name}: the trainer's config: {error}") from error
    try:  # the data it reads, as the trainer's preflight would find it in the job
        check_data(cfg)
    except ValueError as error:
        raise UsageError(f"{name}: the trainer's config: {error}") from error
    return capacity is not None
