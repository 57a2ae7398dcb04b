"""``python -m train.evaluate run_dir=DIR [key=value ...]``: transcribe a cut manifest with a
trained checkpoint and score it (WER, CER).

Run alone or under torchrun at a data-, tensor-, expert-parallel or pipeline layout
(``parallel.*`` as for training; pipeline stages without TP), whatever layout the checkpoint was
saved at: DCP reshards it on load. Utterances (sorted by duration, in batches of
``batch_size``) are dealt out to the data-parallel ranks; each decodes greedily with a KV cache
(train/decode.py); rank 0 gathers the hypotheses and writes
``RUN_DIR/eval/step_<N>/hypotheses.jsonl`` and ``summary.json``. Scoring is train/wer.py's
(normalized text, corpus-level rates).

``run_dir`` may also be a directory ``python -m train.export`` wrote (``train/exported.py``):
the model is then read from its Hugging Face files, sharded, and the results go to its eval/.

Inputs: ``inputs=`` any lhotse cut manifest whose cuts have supervisions and either features
(80 fbank bins, as the corpus stores) or audio (features are then computed here); by default
the test split of the corpus the run trained on. The checkpoint: the newest complete one in
``run_dir``, or ``step=N``, or ``checkpoint=PATH``. Bad input stops every rank with one
``error:`` line and exit code 2 before any process group exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from lhotse import CutSet, Fbank, FbankConfig
from lhotse.cut import Cut
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.nn.utils.rnn import pad_sequence

from contract.configs import EVALUATE_CONFIG, PACKAGED_CONFIGS
from contract.job_end import EXIT_CONFIG
from contract.run_dir import EVAL_DIR, step_name
from train.checkpoint import CheckpointError, CheckpointManager
from train.config import ConfigError, ParallelConfig
from train.data import load_cuts
from train.decode import Stages, greedy_decode, initialize_sharding
from train.exported import SPEECH_CONFIG, Export, is_export, load_export, read_export
from train.layout import checked_dims, model_of
from train.mesh import build_meshes
from train.models.build import build_model, build_pipeline
from train.models.parallelize import ParallelizeOptions
from train.models.salm import ByteTokenizer
from train.models.shape import SALMConfig
from train.parallel_dims import ParallelDims
from train.pipeline_plan import pipeline_plan
from train.prompt import ChatPrompt
from train.saved_run import find_checkpoint, saved_model, saved_state
from train.text import text_codec
from train.trainer import init_distributed, say
from train.validation import rank_share
from train.wer import ErrorCounts, normalize, score_pair

NUM_MEL_BINS = 80  # the corpus's fbank features (recipes/make_corpus.py)


@dataclass
class EvaluateConfig:
    run_dir: str = MISSING  # the training run: its checkpoints/, and eval/ for the results
    checkpoint: str | None = None  # a step_<N> directory; default the newest complete one
    step: int | None = None  # or the checkpoint of this step in run_dir
    inputs: str | None = None  # a lhotse cut manifest; default the run's corpus test split
    split: str | None = None  # its name in the summary; default "test", or the file's name
    batch_size: int = 16  # utterances per batch and data-parallel rank
    max_new_tokens: int = 128  # the longest transcript decoded, in tokens (bytes)
    kv_cache: bool = True  # false recomputes every position at each step (a baseline)
    strategy: str = "fsdp2"
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(dp_shard=1))


@dataclass(frozen=True)
class Plan:
    """What preflight resolved: the checkpoint, its step and model, the inputs, the layout."""

    source: Path | Export  # the checkpoint, or an export (train/exported.py)
    step: int
    model: SALMConfig  # the shape the run trained (a preset, or with a pretrained LLM)
    text: ByteTokenizer | ChatPrompt  # the run's prompt, decoding and end tokens
    inputs: Path
    split: str
    dims: ParallelDims


def check_inputs(path: Path) -> int:
    """The manifest's cut count, once every cut is shown to be usable."""
    if not path.is_file():
        raise ConfigError(f"inputs={path} does not exist; pass a lhotse cut manifest")
    if ".jsonl" not in path.name:
        raise ConfigError(f"inputs={path}: give a lhotse cut manifest in JSONL (*.jsonl[.gz])")
    try:
        cuts = list(CutSet.from_jsonl_lazy(path))
    except Exception as error:
        raise ConfigError(f"inputs={path} is not a lhotse cut manifest: {error}") from None
    if not cuts:
        raise ConfigError(f"inputs={path} holds no cuts")
    for cut in cuts:
        if not cut.supervisions:
            raise ConfigError(
                f"inputs={path}: cut {cut.id} has no supervision, so no reference transcript"
            )
        if not (cut.has_features or cut.has_recording):
            raise ConfigError(f"inputs={path}: cut {cut.id} has neither features nor audio")
    return len(cuts)


def layout(cfg: EvaluateConfig, model: SALMConfig, world_size: int) -> ParallelDims:
    p = cfg.parallel
    if p.cp != 1:
        raise ConfigError(
            "parallel.cp=1 for evaluation: decoding keeps every position in its KV cache, so "
            "context parallelism has nothing to split; a checkpoint saved at cp>1 loads at any "
            "other layout"
        )
    if p.pp > 1 and (p.tp > 1 or not cfg.kv_cache):
        raise ConfigError(
            "evaluation in pipeline stages (parallel.pp>1) runs at parallel.tp=1, with the KV cache"
        )
    dp_replicate = p.dp_replicate
    if p.dp_shard == 1 and p.ep == 1 and dp_replicate in (1, -1):
        dp_replicate = world_size // max(p.tp * p.pp, 1)  # whole replicas: nothing to wait on
    degrees = dataclasses.replace(p, dp_replicate=dp_replicate)
    return checked_dims(world_size, degrees, model, cfg.strategy)


def preflight(cfg: EvaluateConfig) -> Plan:
    """Everything checkable before a process group exists."""
    if cfg.batch_size < 1 or cfg.max_new_tokens < 1:
        raise ConfigError("batch_size and max_new_tokens must be at least 1")
    if not cfg.kv_cache and cfg.parallel.tp > 1:
        raise ConfigError("kv_cache=false (the baseline without a cache) runs at parallel.tp=1")
    run_dir = Path(cfg.run_dir)
    if is_export(run_dir):
        if cfg.checkpoint or cfg.step is not None:
            raise ConfigError(
                f"run_dir={run_dir} is an export (one step, {SPEECH_CONFIG}): drop step= and "
                "checkpoint="
            )
        source = read_export(run_dir)
        model, step, corpus = source.model, source.step, source.corpus
    else:
        source = find_checkpoint(run_dir, cfg.checkpoint, cfg.step)
        state = saved_state(source)
        model, step = saved_model(source, state), int(state["step"])
        corpus = state.get("trainer_state", {}).get("corpus")
    if cfg.inputs:
        inputs = Path(cfg.inputs)
        split = cfg.split or inputs.name.split(".")[0].removeprefix("cuts_")
    elif corpus:
        inputs = Path(corpus) / "cuts_test.jsonl.gz"
        split = cfg.split or "test"
    else:
        raise ConfigError(f"{run_dir} does not record its corpus: pass inputs=MANIFEST")
    check_inputs(inputs)
    shape = model_of(model)
    text = text_codec(model, shape.vocab_size)
    dims = layout(cfg, shape, int(os.environ.get("WORLD_SIZE", "1")))
    return Plan(source, step, shape, text, inputs, split, dims)


def features_of(cut: Cut) -> torch.Tensor:
    if cut.has_features:
        return torch.from_numpy(cut.load_features())
    extractor = Fbank(FbankConfig(num_filters=NUM_MEL_BINS))
    return torch.from_numpy(cut.compute_features(extractor))


def transcript(cut: Cut) -> str:
    return " ".join(s.text or "" for s in cut.supervisions)


class Evaluation:
    def __init__(self, cfg: EvaluateConfig, plan: Plan, device: torch.device) -> None:
        self.cfg, self.plan, self.device = cfg, plan, device
        self.rank = dist.get_rank()
        meshes = build_meshes(plan.dims, device.type)
        options = ParallelizeOptions(
            strategy=cfg.strategy,
            activation_checkpointing="none",
            compile=False,
            mixed_precision=False,
        )
        model_cfg = plan.model
        self.stages = None
        if plan.dims.pp_enabled:  # one stage per rank, split as training balances it
            pipeline = pipeline_plan(model_cfg, plan.dims.pp, "1f1b", 0, 1, [])
            [self.model] = build_pipeline(model_cfg, device, 0, meshes, options, pipeline)
            self.stages = Stages.of(meshes.pp.get_group())
            if self.rank == 0:  # the stage split (the schedule is training's business)
                say("evaluate: " + pipeline.describe().split("; ", 1)[1])
        else:
            self.model = build_model(model_cfg, device, 0, meshes, options)
        self.model.eval()
        if isinstance(plan.source, Export):
            load_export(self.model, plan.source)
        else:
            CheckpointManager(Path(cfg.run_dir)).load(plan.source, self.model, None, None)
        initialize_sharding(self.model)
        coords = plan.dims.coordinates(self.rank)
        self.dp_rank, self.dp_size = coords.dp_rank, coords.dp_size

    def batches(self) -> tuple[list[list[Cut]], int, list[Cut]]:
        """This rank's batches, how many every rank runs, and the filler a rank short of
        batches decodes and discards (its own first batch, else the manifest's first)."""
        cuts = sorted(load_cuts(self.plan.inputs), key=lambda cut: (cut.duration, cut.id))
        size = self.cfg.batch_size
        batches = [cuts[start : start + size] for start in range(0, len(cuts), size)]
        indices, forwards = rank_share(len(batches), self.dp_rank, self.dp_size)
        mine = [batches[index] for index in indices]
        return mine, forwards, (mine or batches)[0]

    def any_active(self, mine: bool) -> bool:
        flag = torch.tensor([float(mine)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def decode(self, cuts: list[Cut]) -> list[str]:
        features = [features_of(cut) for cut in cuts]
        lens = torch.tensor([len(f) for f in features])
        padded = pad_sequence(features, batch_first=True).to(self.device)
        ids = greedy_decode(
            self.model,
            padded,
            lens.to(self.device),
            self.cfg.max_new_tokens,
            self.any_active,
            use_cache=self.cfg.kv_cache,
            batch_multiple=self.plan.dims.tp,
            stages=self.stages,
            prompt=self.plan.text.generation_prompt(),
            eos_ids=self.plan.text.eos_ids,
        )
        return [self.plan.text.decode(row) for row in ids]

    def run(self) -> dict | None:
        mine, forwards, filler = self.batches()
        started = time.perf_counter()
        rows, audio_s = [], 0.0
        for index in range(forwards):
            counts = index < len(mine)
            cuts = mine[index] if counts else filler
            hypotheses = self.decode(cuts)
            if counts:
                audio_s += sum(cut.duration for cut in cuts)
                rows += [
                    {"id": cut.id, "reference": transcript(cut), "hypothesis": hypothesis}
                    for cut, hypothesis in zip(cuts, hypotheses, strict=True)
                ]
                if self.rank == 0:
                    say(
                        f"evaluate: batch {index + 1}/{forwards} on rank 0 ({len(rows)} utterances)"
                    )
        elapsed = time.perf_counter() - started
        gathered: list = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object((rows, audio_s), gathered, dst=0)
        if self.rank != 0:
            return None
        return self.write(gathered, elapsed)

    def write(self, gathered: list, elapsed: float) -> dict:
        by_id: dict[str, dict] = {}
        audio_by_dp: dict[int, float] = {}
        for rank, (rows, audio_s) in enumerate(gathered):
            by_id.update({row["id"]: row for row in rows})  # TP/EP peers decode the same ones
            audio_by_dp[self.plan.dims.coordinates(rank).dp_rank] = audio_s
        rows = [by_id[key] for key in sorted(by_id)]
        counts = ErrorCounts()
        for row in rows:
            scored = score_pair(row["reference"], row["hypothesis"])
            row["normalized_reference"] = normalize(row["reference"])
            row["normalized_hypothesis"] = normalize(row["hypothesis"])
            counts += scored
        out = Path(self.cfg.run_dir) / EVAL_DIR / step_name(self.plan.step)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "hypotheses.jsonl").open("w", encoding="utf-8") as file:
            for row in rows:
                file.write(json.dumps(row) + "\n")
        audio_s = sum(audio_by_dp.values())
        source = self.plan.source
        summary = {
            "step": self.plan.step,
            "split": self.plan.split,
            "inputs": str(self.plan.inputs),
            "checkpoint": str(source.directory if isinstance(source, Export) else source),
            "num_utterances": len(rows),
            "wer": counts.wer,
            "cer": counts.cer,
            "errors": asdict(counts),
            "utterances_per_s": len(rows) / elapsed,
            "real_time_factor": elapsed / audio_s if audio_s else None,
            "decode_s": elapsed,
            "layout": self.plan.dims.describe(),
            "kv_cache": self.cfg.kv_cache,
            "batch_size": self.cfg.batch_size,
            "max_new_tokens": self.cfg.max_new_tokens,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        say(
            f"evaluate: step {self.plan.step} {self.plan.split}: WER {100 * counts.wer:.2f}% "
            f"CER {100 * counts.cer:.2f}% over {len(rows)} utterances "
            f"({summary['utterances_per_s']:.1f} utt/s); hypotheses in {out / 'hypotheses.jsonl'}"
        )
        return summary


def register() -> None:
    ConfigStore.instance().store(name="evaluate_schema", node=EvaluateConfig)


register()


@hydra.main(version_base=None, config_path=PACKAGED_CONFIGS, config_name=EVALUATE_CONFIG)
def main(raw: DictConfig) -> None:
    cfg: EvaluateConfig = OmegaConf.to_object(raw)  # type: ignore[assignment]
    try:
        plan = preflight(cfg)
    except (ConfigError, CheckpointError) as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    device = init_distributed()
    try:
        Evaluation(cfg, plan, device).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
