"""Pipeline stages of the SALM, run by ``torch.distributed.pipelining`` schedules.

Each stage is a `PipelinePart`: a copy of the whole model built on the meta device and pruned to
the modules its stage runs, so its parameters keep the whole model's names (DCP reshards between
any stage split, and ``init_weights`` gives every stage the single process's values). A rank
builds the parts of its stages (see ``train.parallel.pipeline_plan``), parallelizes each like a
whole model (TP, EP, AC, compile, FSDP2 per part), and a `PipelineRunner` feeds them microbatches.

What travels between stages is the decoder's hidden state (microbatch, S / tp, d): under TP each
rank sends its own sequence shard. The padding mask goes to every stage as a keyword input, the
labels to the last stage as the schedule's target. Each stage's MoE balance loss joins the
backward through `with_aux_gradient`, not through what it sends.

Speech batches change shape every step (dynamic bucketing). A schedule's stages are built with
static shape metadata for one shape, so the runner keeps one schedule per shape it has seen (a
small LRU cache): a new shape costs building two small objects and one P2P warm-up, never a
metadata-inference forward, and every rank of a pipeline agrees on shapes because PP peers read
the same batches. Microbatches must share one shape, so a batch is padded with empty examples to
a multiple of the microbatch count and packed to one sequence length; an empty example has no
targets and no real positions, so it changes no loss and no gradient, only costs its compute.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, deque

import torch
import torch.distributed as dist
from torch import nn

from train.loop.step import host_seq_len, to_device
from train.models.batch import Batch
from train.models.context import shard_sequence
from train.models.frame_packing import EncoderPlan, encoder_plan
from train.models.loss import aux_weight
from train.models.packing import batch_layout, segments
from train.models.salm import SALM, embed_inputs
from train.models.shape import PAD_ID, audio_positions
from train.parallel.pipeline_plan import MULTI_STAGE_SCHEDULES, PipelinePlan

# torch's schedule classes by the name ``parallel.pp_schedule`` gives; imported when a pipeline
# is built (torch.distributed.pipelining imports dynamo: ~1 CPU-second of every rank's start-up).
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}
SCHEDULES_CACHED = 8  # distinct batch shapes whose schedules are kept


class _AuxGradient(torch.autograd.Function):
    """Identity on ``x`` whose backward also gives ``aux`` a gradient of one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return x.clone()  # not a view: FSDP hooks the stage's output for its backward

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.aux_like
        return grad, torch.ones(shape, dtype=dtype, device=device)


def with_aux_gradient(x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged, with ``aux`` added to the loss the backward differentiates: a stage's
    balance loss is part of the total without being sent to the next stage."""
    return _AuxGradient.apply(x, aux)


class PipelinePart(nn.Module):
    """One pipeline stage of the SALM under the whole model's parameter names.

    ``model`` must be a fresh copy (the part prunes its decoder in place). The first stage
    takes the batch (features, feature lengths, tokens, token lengths[, prompt]) and builds the
    decoder's input; the others take the previous stage's hidden state. Every stage returns its
    blocks' output: the last one's goes to the runner's loss, which applies the final norm and
    the head a chunk of positions at a time (train/models/head_loss.py).
    """

    def __init__(self, model: SALM, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.seq_multiple = model.seq_multiple
        self.loss_chunk = model.loss_chunk
        self.encoder = model.encoder if first else None
        self.projector = model.projector if first else None
        llm = model.llm
        if not first:
            llm.embed = None
        if not last:
            llm.norm = None
            llm.lm_head = None
        for key in list(llm.layers):
            if int(key) not in blocks:
                del llm.layers[key]
        self.llm = llm
        # Set per step by the runner: dp_size / global sequences, for the balance loss.
        self.aux_scale = 0.0
        self.aux_total: torch.Tensor | None = None  # this step's weighted balance-loss sum
        # The first stage's: each microbatch's encoder plan (the segments that hold audio, their
        # packing), read on the host by the runner (train.models.frame_packing.encoder_plan),
        # taken in microbatch order, the order in which every schedule runs a stage's forwards.
        self.encoder_plans: deque[EncoderPlan] = deque()

    def forward(self, *inputs: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        if self.encoder is not None:
            cp = 1 if self.llm.cp_mesh is None else self.llm.cp_mesh.size()
            batch, seq_len = Batch(*inputs), token_mask.shape[1] * cp
            plan = self.encoder_plans.popleft() if self.encoder_plans else None
            x, _ = embed_inputs(self.encoder, self.projector, self.llm.embed, batch, seq_len, plan)
            (x,) = self.llm.enter(x)
        else:
            (x,) = inputs
        out, aux = self.llm(x, token_mask, head=False)
        if not self.cfg.n_experts:
            return out
        aux = aux_weight(self.cfg) * aux
        detached = aux.detach()
        self.aux_total = detached if self.aux_total is None else self.aux_total + detached
        return with_aux_gradient(out, aux * self.aux_scale)


def pipeline_parts(model_on_meta: SALM, plan: PipelinePlan, pp_rank: int) -> list[PipelinePart]:
    """The parts of this rank's stages, each pruned from its own copy of the meta model."""
    parts = []
    for stage in plan.local_stages(pp_rank):
        copy_on_meta = copy.deepcopy(model_on_meta)
        first, last = stage == 0, stage == plan.num_stages - 1
        parts.append(PipelinePart(copy_on_meta, plan.stage_blocks(stage), first, last))
    return parts


def pad_examples(batch: Batch, multiple: int) -> Batch:
    """``batch`` with empty examples appended up to a multiple of ``multiple`` examples: no
    frames, no tokens, so no targets and no real positions."""
    missing = -len(batch.tokens) % multiple
    if not missing:
        return batch
    padded = {}
    for name, tensor in batch._asdict().items():
        fill = PAD_ID if name == "tokens" else 0  # zeros and False elsewhere
        padding = tensor.new_full((missing, *tensor.shape[1:]), fill)
        padded[name] = torch.cat([tensor, padding])
    return Batch(**padded)


class PipelineRunner:
    """Runs one schedule step per batch over this rank's parts and keeps the loss sums."""

    def __init__(
        self,
        parts: list[PipelinePart],
        plan: PipelinePlan,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        hidden_dtype: torch.dtype,
        tp: int,
    ) -> None:
        self.parts = parts
        self.plan = plan
        self.group = pp_group
        self.device = device
        self.hidden_dtype = hidden_dtype
        self.tp = tp
        self.pp_rank = dist.get_rank(pp_group)
        self.stage_ids = plan.local_stages(self.pp_rank)
        self.has_first = 0 in self.stage_ids
        self.has_last = plan.num_stages - 1 in self.stage_ids
        # The last stage's part, whose norm and head the schedule's loss applies.
        self.head_part = parts[self.stage_ids.index(plan.num_stages - 1)] if self.has_last else None
        self.cp_mesh = parts[0].llm.cp_mesh
        self.cp = 1 if self.cp_mesh is None else self.cp_mesh.size()
        self.schedules: OrderedDict[tuple, object] = OrderedDict()
        self.loss_scale = torch.zeros((), device=device)
        self.nll_total = torch.zeros((), device=device)

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one microbatch: the last stage's blocks' output through its
        norm and head. Their parameters stay gathered from the stage's forward to its backward
        (FSDP keeps a pipeline stage's parameters gathered), and their gradients reach FSDP
        before the stage's own backward does."""
        nll = self.head_part.llm.head_loss(hidden, labels, self.head_part.loss_chunk)
        self.nll_total = self.nll_total + nll.detach()
        return nll * self.loss_scale

    def _schedule(self, batch: Batch, seq_len: int):
        """The schedule for this batch shape, built with static stage metadata."""
        micro = len(batch.tokens) // self.plan.microbatches
        key = (micro, seq_len, *(tuple(t.shape[1:]) for t in batch))
        if key in self.schedules:
            self.schedules.move_to_end(key)
            return self.schedules[key]
        cfg = self.parts[0].cfg
        hidden = torch.empty(
            (micro, seq_len // (self.cp * self.tp), cfg.d_model),
            dtype=self.hidden_dtype,
            device="meta",
            requires_grad=True,
        )
        first_inputs = tuple(
            torch.empty((micro, *t.shape[1:]), dtype=t.dtype, device="meta") for t in batch
        )
        from torch.distributed import pipelining  # here, not at import: it imports dynamo

        stages = []
        for stage_id, part in zip(self.stage_ids, self.parts, strict=True):
            stages.append(
                pipelining.PipelineStage(
                    part,
                    stage_id,
                    self.plan.num_stages,
                    self.device,
                    input_args=first_inputs if stage_id == 0 else hidden,
                    output_args=hidden,
                    group=self.group,
                )
            )
        schedule_class = getattr(pipelining, SCHEDULE_CLASSES[self.plan.schedule])
        schedule = schedule_class(
            stages if self.plan.schedule in MULTI_STAGE_SCHEDULES else stages[0],
            n_microbatches=self.plan.microbatches,
            loss_fn=self._loss,
            scale_grads=False,
        )
        self.schedules[key] = schedule
        if len(self.schedules) > SCHEDULES_CACHED:
            self.schedules.popitem(last=False)
        return schedule

    def forward_backward(
        self,
        batches: list[Batch],
        global_targets: torch.Tensor,
        global_sequences: torch.Tensor,
        gradient_ranks: int,
    ) -> torch.Tensor:
        """One schedule step per batch (CPU tensors; accumulated gradients); returns
        [next-token loss sum, weighted balance-loss sum] of this rank's stages over all of them
        (the loss sum is zero but on the last stage's rank)."""
        self.loss_scale = gradient_ranks / global_targets
        aux_scale = gradient_ranks / global_sequences
        sums = torch.zeros(2, device=self.device)
        for batch in batches:
            schedule, inputs, kwargs = self._prepare(batch, aux_scale)
            schedule.step(*inputs, return_outputs=False, **kwargs)
            aux = sum(
                (part.aux_total.float() for part in self.parts if part.aux_total is not None),
                torch.zeros((), device=self.device),
            )
            sums += torch.stack([self.nll_total.float(), aux])
        return sums

    @torch.no_grad()
    def loss_sum(self, batch: Batch) -> torch.Tensor:
        """The next-token loss sum of one batch, forward only (validation): zero but on the
        last stage's rank."""
        schedule, inputs, kwargs = self._prepare(batch, torch.zeros((), device=self.device))
        schedule.eval(*inputs, **kwargs)
        return self.nll_total.float()

    def _prepare(self, batch: Batch, aux_scale: torch.Tensor):
        """The schedule for ``batch`` and the arguments of its step on this rank."""
        batch = pad_examples(batch.with_prompt(), self.plan.microbatches)
        seq_len = host_seq_len(batch, self.parts[0])
        schedule = self._schedule(batch, seq_len)
        for part in self.parts:
            if part.encoder is not None:  # the first stage's
                part.encoder_plans = microbatch_plans(
                    part, batch, self.plan.microbatches, self.device
                )
        batch = to_device(batch, self.device)
        feature_lens = segments(batch.features, batch.feature_lens)[1]
        layout = batch_layout(batch, audio_positions(self.parts[0].cfg, feature_lens), seq_len)
        token_mask, labels = layout.token_mask, layout.labels
        if self.cp_mesh is not None:  # each rank's chunks of the sequence
            token_mask, labels = (shard_sequence(t, self.cp_mesh) for t in (token_mask, labels))
        self.nll_total = torch.zeros((), device=self.device)
        for part in self.parts:
            part.aux_scale = aux_scale
            part.aux_total = None
        inputs = batch if self.has_first else ()
        kwargs = {"target": labels if self.has_last else None, "token_mask": token_mask}
        return schedule, inputs, kwargs


def microbatch_plans(
    stage: PipelinePart, batch: Batch, microbatches: int, device: torch.device
) -> deque[EncoderPlan]:
    """Each microbatch's encoder plan (``train.models.frame_packing.encoder_plan``) for the
    first ``stage``, from the CPU batch that the schedule splits into ``microbatches`` equal runs
    of examples (a multiple of them: ``pad_examples``), on ``device``."""
    size = len(batch.feature_lens) // microbatches
    return deque(
        encoder_plan(stage.cfg, stage.encoder, batch.feature_lens[start : start + size]).to(device)
        for start in range(0, len(batch.feature_lens), size)
    )


def merged_view(parts: list[nn.Module]) -> nn.Module:
    """One module over this rank's stages with the whole model's parameter names, for what
    sees all of a rank's parameters at once: the optimizer, gradient clipping, checkpoints."""
    if len(parts) == 1:
        return parts[0]
    view, llm = nn.Module(), nn.Module()
    llm.layers = nn.ModuleDict()
    for part in parts:
        for name in ("encoder", "projector"):
            if getattr(part, name) is not None:
                setattr(view, name, getattr(part, name))
        for name in ("embed", "norm", "lm_head"):
            if getattr(part.llm, name) is not None:
                setattr(llm, name, getattr(part.llm, name))
        for key, block in part.llm.layers.items():
            llm.layers[key] = block
    view.llm = llm
    return view
