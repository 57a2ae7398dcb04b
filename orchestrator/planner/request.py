"""What the planner is asked and what it answers: a request (the model, the batch, the
cluster), a parallel layout, and each layout's estimate. Types only, shared by the search
(``planner.search``), the step-time model (``planner.speed``), the plan check and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.planner.cluster import Cluster
from orchestrator.planner.costs import FITTED, StepConstants
from train.models.shape import SALMConfig
from train.parallel.dims import AC_MODES, DEFAULT_LOSS_CHUNK, Degrees, ParallelDims

FRAMES_PER_SECOND = 100  # fbank frames (10 ms hop)


@dataclass(frozen=True)
class PlanRequest:
    model: SALMConfig
    seconds: float  # audio per sequence
    tokens: int  # transcript tokens per sequence
    global_batch: int  # sequences per optimizer step
    cluster: Cluster
    ac_modes: tuple[str, ...] = AC_MODES
    mixed_precision: bool = True  # bf16 compute (FSDP2's mixed precision)
    on_gpu: bool = True  # False: a CPU recipe checked against host memory
    strategy: str = "fsdp2"  # or ddp (whole replicas)
    frozen: frozenset[str] = frozenset()  # parameter names model.freeze leaves frozen
    # The frozen ones a checkpoint holds by reference (checkpoint.by_reference: those of a
    # pretrained LLM or encoder): no bytes in a checkpoint.
    referenced: frozenset[str] = frozenset()
    compiled: bool = True  # torch.compile per block (the GPU recipes' default); False: eager
    # The loss's chunk of positions (train.loss_chunk); 0: a loss over the full logits, as
    # torchtitan (the published measurements) and our trainer before 2026-11-29 held them.
    loss_chunk: int = DEFAULT_LOSS_CHUNK
    llm_only: bool = False  # the LLM alone: no encoder or projector (text-only training)
    constants: StepConstants = FITTED  # the step-time constants fitted to measured steps

    @property
    def frames(self) -> int:
        return max(0, round(self.seconds * FRAMES_PER_SECOND))

    @property
    def element_bytes(self) -> int:
        return 2 if self.mixed_precision and self.on_gpu else 4


@dataclass
class Layout(Degrees):
    """The degrees (``train.parallel.dims.Degrees``) and how a step is cut into microbatches."""

    microbatch: int  # sequences per microbatch and data-parallel rank
    microbatches: int  # per optimizer step: pipeline microbatches or gradient accumulation
    ac: str
    schedule: str = "1f1b"
    stages_per_rank: int = 0  # 0: the schedule's default (parallel.pp_stages_per_rank)
    pp_split: tuple[int, ...] = ()  # LLM blocks per stage; empty: balanced (parallel.pp_split)

    def dims(self, world: int) -> ParallelDims:
        return ParallelDims.of(world, self)

    def overrides(self, seconds: float) -> list[str]:
        """Hydra overrides for the trainer (``data.max_duration`` is per microbatch)."""
        lines = [f"parallel.{name}={value}" for name, value in self.degrees().items()]
        if self.pp > 1:
            lines.append(f"parallel.pp_microbatches={self.microbatches}")
            per_rank = seconds * self.microbatch * self.microbatches
        else:
            lines.append(f"train.grad_accum={self.microbatches}")
            per_rank = seconds * self.microbatch
        if per_rank > 0:  # the trainer's batches are seconds of audio per data-parallel rank
            lines.append(f"data.max_duration={per_rank:g}")
        lines.append(f"activation_checkpointing={self.ac}")
        return lines

    def describe(self) -> str:
        degrees = " ".join(f"{name}={value}" for name, value in self.degrees().items())
        return f"{degrees} microbatches={self.microbatches} (of {self.microbatch} seq) ac={self.ac}"


@dataclass
class Estimate:
    layout: Layout
    memory: dict[str, float]  # bytes per GPU by kind, and "total"
    fits: bool
    step_time_s: float
    mfu: float
    reasoning: str
    penalty: int  # flowchart rules broken (0 for the flowchart's own answer)
    reason: str = ""  # why it does not fit
    times: dict[str, float] = field(default_factory=dict)
    cross_node_bytes: float = 0.0  # what a GPU sends across nodes per step (speed.cross_node_bytes)


@dataclass
class PlanResult:
    request: PlanRequest
    params: int
    trainable: int  # the parameters model.freeze leaves training
    estimates: list[Estimate]  # feasible first (best first), then those that do not fit
    fits_one_gpu: bool
    one_gpu_bytes: float
    checkpoint_bytes: int  # one checkpoint's weights and optimizer states (state.checkpoint_bytes)

    @property
    def feasible(self) -> list[Estimate]:
        return [e for e in self.estimates if e.fits]

    @property
    def best(self) -> Estimate | None:
        feasible = self.feasible
        return feasible[0] if feasible else None
