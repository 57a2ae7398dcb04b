"""The layouts the planner's memory model is measured at, and the launches that measure them.

tests/test_planner_memory.py (state bytes) and tests/test_planner_activations.py (activations
under TP, CP and PP) read the same runs: one launch of tests/harness/workers/planner_worker.py
per world size (1, 2 and 4 gloo ranks, forked from the zygote: harness/process.run_python),
each training every case of that size in turn, made once per test session. No torch here: the
test process stays torch-free.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.harness.process import REPO, run_python
from train.config import LoraConfig, ModelConfig, TrainConfig
from train.models.hf_names import PROJECTIONS
from train.models.inventory import inventory, stage_param_counts
from train.models.shape import SALMConfig
from train.parallel.dims import DENSE_DIMS, ParallelDims
from train.parallel.layout import frozen_of, model_of
from train.parallel.pipeline_plan import PipelinePlan, plan_pipeline

WORKER = REPO / "tests/harness/workers/planner_worker.py"
# An LLM-heavy batch (16 fbank frames, 508 tokens: 512 decoder positions): the blocks and the
# head, which TP, CP and PP split, hold nearly all of it, so a wrong split shows.
ACTIVATION_BATCH = (4, 16, 508)


@dataclass(frozen=True)
class Case:
    """One layout of ``ranks`` ranks: trainer settings, and whether to measure activations."""

    ranks: int
    preset: str
    parallel: dict[str, int] = field(default_factory=dict)  # the trainer's parallel.* keys
    strategy: str = "fsdp2"
    bf16: bool = False  # FSDP2's mixed precision, on CPU (tests/harness/workers/planner_worker.py)
    activations: bool = False
    batch: tuple[int, int, int] = (2, 16, 40)  # sequences, fbank frames, tokens per rank
    freeze: tuple[str, ...] = ()  # model.freeze and model.unfreeze
    unfreeze: tuple[str, ...] = ()
    lora_rank: int = 0  # LoRA adapters on every projection of the LLM

    def model(self) -> ModelConfig:
        """The trainer's model settings of the case."""
        lora = LoraConfig(rank=self.lora_rank, target_modules=list(PROJECTIONS))
        return ModelConfig(
            preset=self.preset, freeze=list(self.freeze), unfreeze=list(self.unfreeze), lora=lora
        )

    def shape(self) -> SALMConfig:
        return model_of(self.model())

    def frozen(self) -> frozenset[str]:
        """The parameter names the case leaves frozen, as the trainer finds them."""
        return frozenset(frozen_of(TrainConfig(model=self.model())))

    def dims(self) -> ParallelDims:
        sizes = {key: value for key, value in self.parallel.items() if key in DENSE_DIMS}
        return ParallelDims(world_size=self.ranks, **sizes)


TP2, CP2, PP2 = {"tp": 2, "dp_shard": 1}, {"cp": 2, "dp_shard": 1}, {"pp": 2, "dp_shard": 1}
CASES = {
    "one_process": Case(1, "tiny", activations=True, batch=ACTIVATION_BATCH),
    "ddp2": Case(2, "tiny", {"dp_replicate": 2, "dp_shard": 1}, strategy="ddp"),
    "fsdp2": Case(2, "tiny"),
    "fsdp2_bf16": Case(2, "tiny", bf16=True),
    "tp2": Case(2, "tiny", TP2, activations=True, batch=ACTIVATION_BATCH),
    "cp2": Case(2, "tiny", CP2, activations=True, batch=ACTIVATION_BATCH),
    "pp2": Case(2, "tiny", {**PP2, "pp_microbatches": 4}, activations=True, batch=ACTIVATION_BATCH),
    "moe_ep2": Case(2, "tiny_moe", {"ep": 2}),
    "moe_tp2": Case(2, "tiny_moe", TP2),
    "hsdp2x2": Case(4, "tiny", {"dp_replicate": 2, "dp_shard": 2}),
    "fsdp2xtp2": Case(4, "tiny", {"tp": 2, "dp_shard": 2}),
    "pp2xfsdp2": Case(4, "tiny", {"pp": 2, "dp_shard": 2}),
    # The LLM frozen but its last block: stage 0 trains the encoder only, stage 1 one block.
    "pp2xfsdp2_frozen_llm": Case(
        4, "tiny", {"pp": 2, "dp_shard": 2}, freeze=(r"^llm\.",), unfreeze=(r"llm\.layers\.1\.",)
    ),
    "moe_fsdp2xtp2_ep2": Case(4, "tiny_moe", {"tp": 2, "dp_shard": 2, "ep": 2}),
    # LoRA: the LLM frozen, adapters A whole or split over TP beside their bases, B likewise.
    "fsdp2xtp2_lora": Case(4, "tiny", {"tp": 2, "dp_shard": 2}, lora_rank=4),
}


@dataclass(frozen=True)
class Launch:
    rows: tuple[dict, ...]  # per case, per rank: {"case", "rank", the measured bytes}
    error: str  # the launch's stderr tail when it failed, else ""


@functools.cache
def launch(ranks: int) -> Launch:
    """Every case of ``ranks`` ranks, measured in one launch (kept for the session)."""
    cases = {name: case for name, case in CASES.items() if case.ranks == ranks}
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "cases.json", Path(tmp) / "rows.json"
        spec.write_text(json.dumps({name: asdict(case) for name, case in cases.items()}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        done = run_python([str(WORKER), str(out), str(spec)], ranks, env)
        if done.returncode:
            return Launch((), done.stderr[-3000:])
        return Launch(tuple(json.loads(out.read_text())), "")


def measured(name: str) -> list[dict]:
    """Each rank's measurements of case ``name``, by rank."""
    result = launch(CASES[name].ranks)
    assert not result.error, result.error
    rows = sorted((row for row in result.rows if row["case"] == name), key=lambda r: r["rank"])
    assert [row["rank"] for row in rows] == list(range(CASES[name].ranks))
    return rows


def pipeline(cfg: SALMConfig, dims: ParallelDims) -> PipelinePlan | None:
    """The trainer's balanced 1F1B stage split for ``dims`` (None without a pipeline)."""
    if dims.pp == 1:
        return None
    blocks, first, last = stage_param_counts(inventory(cfg), cfg.n_layers)
    return plan_pipeline(dims.pp, "1f1b", 0, 0, [], blocks, first, last)
