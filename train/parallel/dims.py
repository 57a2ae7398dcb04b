"""The parallel layout of one training job, as plain arithmetic (no process groups).

`ParallelDims` is the single source of truth for how the world is split. Ranks are laid out
row-major with tensor parallelism innermost, so TP peers sit on neighbouring ranks (one node),
and pipeline parallelism outermost, so pipeline stages span nodes:

    dense view  (pp, dp_replicate, dp_shard, cp, tp)   attention, dense FFN, encoder, embeddings
    sparse view (pp, dp_replicate, efsdp, ep)          MoE experts; ep * efsdp == dp_shard*cp*tp

Context parallelism splits each sequence over cp ranks that read the same batch; FSDP shards
over dp_shard x cp (as in torchtitan), since CP ranks hold the same parameters. Expert
parallelism is carved out of the dp_shard x cp x tp ranks (as in torchtitan with etp=1): ep
ranks hold different experts, and FSDP shards each expert over the remaining efsdp ranks.
Data loading only needs `coordinates(rank)`, so it never has to build a mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Protocol

DENSE_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SPARSE_DIMS = ("pp", "dp_replicate", "efsdp", "ep")
DP_VIEW = "dp"
STRATEGIES = ("ddp", "fsdp2")
# Activation checkpointing per block (train/models/parallelize.py), least memory saved first:
# the trainer's activation_checkpointing values, in the order the planner tries them.
# ``selective_op`` is torchtitan's per-op policy: every second matmul's output recomputed.
SELECTIVE_OP = "selective_op"
AC_MODES = ("none", "selective", SELECTIVE_OP, "full")
BASE_SEQ_MULTIPLE = 8  # packed decoder sequences are a multiple of this at any layout
# Positions whose fp32 logits the loss holds at once (train/models/head_loss.py, train.loss_chunk).
DEFAULT_LOSS_CHUNK = 1024


def sequence_multiple(tp: int = 1, cp: int = 1) -> int:
    """What the decoder's packed sequence length is a multiple of: 8, tp (sequence parallelism
    shards it over tp ranks) and 2 * cp * tp with CP (2 * cp chunks, each then cut over tp)."""
    return math.lcm(BASE_SEQ_MULTIPLE, tp, 2 * cp * tp if cp > 1 else 1)


class ModelShape(Protocol):
    """The model facts the layout must agree with (satisfied by `SALMConfig`)."""

    n_heads: int
    n_kv_heads: int
    n_experts: int
    n_layers: int
    tie_embeddings: bool


@dataclass(kw_only=True)
class Degrees:
    """The parallel degrees, declared once: the trainer's config (``ParallelConfig``), the
    layout of a job (``ParallelDims``), the planner's layouts and its activation model all extend
    this, so a new degree is one field here. Keyword-only, so that each extension's own fields
    keep their places. In the planner's order: data parallelism, then the model splits."""

    dp_replicate: int = 1  # HSDP's replicas (whole copies of the sharded model)
    dp_shard: int = -1  # FSDP's shards; -1 takes what the other degrees leave of the world
    tp: int = 1  # tensor (and sequence) parallelism, inside a node
    cp: int = 1  # context parallelism: the decoder sequence split over cp ranks (same batch)
    pp: int = 1  # pipeline stages (ranks), outermost: stages span nodes
    ep: int = 1  # expert parallelism, carved out of dp_shard x cp x tp

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DEGREES}

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step consumes (once dp_shard
        is resolved)."""
        return self.dp_replicate * self.dp_shard


# Their names, in that order: what a layout's overrides, JSON and one-line spec list.
DEGREES = tuple(degree.name for degree in fields(Degrees))


@dataclass(frozen=True)
class RankCoordinates:
    """Where one global rank sits in the dense and sparse views, and its data-parallel slot."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    efsdp: int
    ep: int
    dp_rank: int
    dp_size: int


@dataclass
class ParallelDims(Degrees):
    """The degrees on ``world_size`` ranks; ``dp_shard=-1`` becomes whatever the others leave."""

    world_size: int

    @classmethod
    def of(cls, world_size: int, degrees: object) -> ParallelDims:
        """The layout of ``world_size`` ranks with the ``DEGREES`` that ``degrees`` holds (the
        trainer's config, as a dataclass or as Hydra composed it; a planner layout)."""
        return cls(world_size, **{name: getattr(degrees, name) for name in DEGREES})

    def __post_init__(self) -> None:
        others = self.dp_replicate * self.tp * self.cp * self.pp
        if self.dp_shard == -1 and others > 0 and self.world_size % others == 0:
            self.dp_shard = self.world_size // others

    def validate(self, model: ModelShape, strategy: str = "fsdp2") -> None:
        """Raise ValueError (one line) for the first way this layout cannot run ``model``."""
        for name in ("world_size", *DEGREES):
            value = getattr(self, name)
            if value < 1 and not (name == "dp_shard" and value == -1):
                raise ValueError(f"{name}={value} must be a positive integer")
        if self.dp_shard == -1:
            others = self.dp_replicate * self.tp * self.cp * self.pp
            raise ValueError(
                f"dp_shard=-1 cannot fill a world of {self.world_size} ranks: it is not a "
                f"multiple of dp_replicate*tp*cp*pp = {others}"
            )
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ValueError(
                f"pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*"
                f"{self.dp_shard}*{self.cp}*{self.tp} = {product} but the world has "
                f"{self.world_size} ranks: make the product match (or set dp_shard=-1)"
            )
        if self.pp > model.n_layers:
            raise ValueError(
                f"pp={self.pp} is more pipeline stages than the model's {model.n_layers} LLM "
                "blocks: every stage needs at least one block; lower pp"
            )
        if self.pp > 1 and model.tie_embeddings:
            raise ValueError(
                f"pp={self.pp} with tied embeddings: the embedding (first stage) and the output "
                "head (last stage) are one matrix, which pipeline stages cannot share; use pp=1 "
                "(such models are small: FSDP or TP fit them)"
            )
        if model.n_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} must divide the {model.n_heads} attention heads: pick another tp"
            )
        if model.n_kv_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} must divide the {model.n_kv_heads} KV heads: pick another tp"
            )
        if self.ep > 1 and model.n_experts == 0:
            raise ValueError(f"ep={self.ep} needs an MoE model, but this model has no experts")
        if model.n_experts % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide the {model.n_experts} experts: pick another ep"
            )
        if self.expert_ranks % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard*cp*tp = {self.expert_ranks}: "
                "expert parallelism is carved out of those ranks"
            )
        if strategy not in STRATEGIES:
            raise ValueError(
                f"unknown data-parallel strategy {strategy!r}: use one of {STRATEGIES}"
            )
        if strategy == "ddp" and (self.dp_shard, self.tp, self.ep, self.pp, self.cp) != (1,) * 5:
            raise ValueError(
                "strategy ddp replicates whole models: it needs dp_shard=1, tp=1, ep=1, pp=1, "
                "cp=1 (use fsdp2 for sharded, TP, EP, pipeline or context-parallel layouts)"
            )

    @property
    def expert_ranks(self) -> int:
        """The ranks of one replica and stage that experts are spread over (ep x efsdp)."""
        return self.dp_shard * self.cp * self.tp

    @property
    def gradient_ranks(self) -> int:
        """Ranks whose gradients FSDP averages (dp x cp): each rank's loss is scaled by this, so
        that the average is the global batch's gradient."""
        return self.dp * self.cp

    @property
    def efsdp(self) -> int:
        """How many ranks FSDP shards each expert over (expert_ranks split between ep and this)."""
        return self.expert_ranks // self.ep

    @property
    def dense_shape(self) -> tuple[int, int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def sparse_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.efsdp, self.ep)

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """Dense-view dims FSDP spans (``dp_shard_cp``: dp_shard x cp flattened); 2-D (HSDP)
        only when there is more than one replica."""
        shard = "dp_shard_cp" if self.cp_enabled else "dp_shard"
        return ("dp_replicate", shard) if self.dp_replicate_enabled else (shard,)

    @property
    def expert_fsdp_dims(self) -> tuple[str, ...]:
        """Sparse-view dims FSDP spans for the experts."""
        return ("dp_replicate", "efsdp") if self.dp_replicate_enabled else ("efsdp",)

    @property
    def seq_multiple(self) -> int:
        return sequence_multiple(self.tp, self.cp)

    def coordinates(self, rank: int) -> RankCoordinates:
        """Named coordinates of global ``rank`` (what the data loader and batch hashes need)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")
        stage, in_stage = divmod(rank, self.world_size // self.pp)
        replica, inner = divmod(in_stage, self.expert_ranks)
        shard, in_shard = divmod(inner, self.cp * self.tp)
        cp, tp = divmod(in_shard, self.tp)
        efsdp, ep = divmod(inner, self.ep)
        return RankCoordinates(
            pp=stage,
            dp_replicate=replica,
            dp_shard=shard,
            cp=cp,
            tp=tp,
            efsdp=efsdp,
            ep=ep,
            dp_rank=replica * self.dp_shard + shard,
            dp_size=self.dp,
        )

    def describe(self) -> str:
        """One line for the logs."""
        return (
            f"world={self.world_size} pp={self.pp} dp_replicate={self.dp_replicate} "
            f"dp_shard={self.dp_shard} cp={self.cp} tp={self.tp} ep={self.ep} (efsdp={self.efsdp}, "
            f"dp={self.dp})"
        )
