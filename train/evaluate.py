"""``python -m train.evaluate run_dir=DIR [key=value ...]``: transcribe test sets with a trained
checkpoint and score each: WER, CER, the word substitutions, deletions and insertions, and the
real-time factor.

Run alone or under torchrun at a data-, tensor-, expert-parallel or pipeline layout
(``parallel.*`` as for training; pipeline stages without TP), whatever layout the checkpoint was
saved at: DCP reshards it on load. The model is loaded once and decodes every set in turn: a
set's utterances (sorted by duration, in batches of ``batch_size``) are dealt out to the
data-parallel ranks; each decodes greedily with a KV cache (train/eval/decode.py) after the prompt
of the set's tags; rank 0 gathers the hypotheses and scores them (train/eval/wer.py: corpus-level
rates, after the normalizer ``normalizer=`` names, train/eval/normalizers.py).

``run_dir`` may also be a directory ``python -m train.export`` wrote (``train/exported.py``):
the model is then read from its Hugging Face files, sharded, and the results go to its eval/.

Test sets: ``sets=`` a source file or an inline list in the source syntax of train/data/sources.py
(cut manifests, Shar directories, recordings + supervisions), each leaf source a set named by
its ``name``; or ``inputs=`` one lhotse cut manifest; by default the test split of the corpus
the run trained on. Each set is checked first (train/data/source_cuts.py): cuts without a
transcript, audio or features are set aside and reported, not decoded; a cut whose audio turns out
unreadable while decoding is skipped the same way. Features are what the run's encoder reads
(train/data/features.py). The checkpoint: the newest complete one in ``run_dir``, or ``step=N``, or
``checkpoint=PATH``. Bad input (a set with no usable cut, a missing file, an unknown normalizer)
stops every rank with one ``error:`` line and exit code 2 before any process group exists.

Results in ``RUN_DIR/eval/step_<N>/``: for one set its ``hypotheses.jsonl`` and
``summary.json``; for several, both in a folder per set and a ``summary.json`` of the pooled
figures with each set's under ``sets``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from lhotse.cut import Cut
from omegaconf import MISSING, DictConfig, OmegaConf

from contract.configs import EVALUATE_CONFIG, PACKAGED_CONFIGS
from contract.job_end import EXIT_CONFIG
from contract.run_dir import EVAL_DIR, step_name
from train.checkpoint.location import Ref
from train.checkpoint.manager import CheckpointError, CheckpointManager
from train.checkpoint.saved_run import find_checkpoint, saved_model, saved_state
from train.config import ConfigError, ParallelConfig, refuse_uncomposable
from train.data.conversation import conversation_of
from train.data.features import BadCut, Extractor, Featurizer, extractor_of
from train.data.loader import encoded, pad_segments
from train.data.prompt import ChatPrompt, Encoded
from train.data.source_cuts import (
    SourceCheck,
    check_sources,
    load_source_cuts,
    transcript,
)
from train.data.sources import Source, check_prompt_tags, read_sources
from train.data.text import ByteTokenizer, text_codec
from train.eval.decode import Stages, greedy_decode, initialize_sharding
from train.eval.normalizers import DEFAULT_NORMALIZER, normalizer
from train.eval.validation import rank_share
from train.eval.wer import ErrorCounts, edit_counts
from train.exported import SPEECH_CONFIG, Export, is_export, load_export, read_export
from train.loop.device_trap import trapped
from train.models.build import build_model, build_pipeline
from train.models.parallelize import ParallelizeOptions
from train.models.shape import SALMConfig
from train.parallel.dims import ParallelDims
from train.parallel.distributed import REFUSAL_GRACE_S, init_distributed, say
from train.parallel.layout import checked_dims, model_of
from train.parallel.mesh import build_meshes
from train.parallel.pipeline_plan import pipeline_plan

SUMMARY_FILE, HYPOTHESES_FILE = "summary.json", "hypotheses.jsonl"


@dataclass
class EvaluateConfig:
    run_dir: str = MISSING  # the training run: its checkpoints/, and eval/ for the results
    checkpoint: str | None = None  # a step_<N> directory; default the newest complete one
    step: int | None = None  # or the checkpoint of this step in run_dir
    inputs: str | None = None  # a lhotse cut manifest; default the run's corpus test split
    # Or several test sets: a source file or an inline list (train/data/sources.py), each source
    # scored as its own set, named by its name:.
    sets: Any = None
    split: str | None = None  # the one set's name; default "test", or the manifest's name
    normalizer: str = DEFAULT_NORMALIZER  # train/eval/normalizers.py: none, basic, whisper_en
    batch_size: int = 16  # utterances per batch and data-parallel rank
    max_new_tokens: int = 128  # the longest transcript decoded, in tokens (bytes)
    kv_cache: bool = True  # false recomputes every position at each step (a baseline)
    # Decoding with tensor factories defaulting to the meta device: a tensor made without
    # device= fails on the CPU as on a GPU (train/loop/device_trap.py, as the trainer's debug
    # option).
    device_trap: bool = False
    strategy: str = "fsdp2"
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(dp_shard=1))


@dataclass(frozen=True)
class EvalSet:
    """One set to decode and score: its checked source and the run's codec for its tags."""

    check: SourceCheck  # the source, and the cuts checking set aside (``excluded``)
    text: ByteTokenizer | ChatPrompt  # its prompt, decoding and end tokens

    @property
    def name(self) -> str:
        return self.check.source.name


@dataclass(frozen=True)
class Plan:
    """What preflight resolved: the checkpoint, its step and model, the sets, the layout."""

    source: Ref | Export  # the checkpoint, or an export (train/exported.py)
    step: int
    model: SALMConfig  # the shape the run trained (a preset, or with a pretrained LLM)
    extractor: Extractor  # the features its encoder reads
    sets: tuple[EvalSet, ...]
    normalizer: str  # the name of the normalizer both sides are scored after
    dims: ParallelDims


def sources_of(cfg: EvaluateConfig, corpus: str | None, run_dir: Path) -> list[Source]:
    """The sets to score: the sources of ``sets=``, else ``inputs=``, else the corpus test split."""
    if cfg.sets:
        if cfg.inputs or cfg.split:
            raise ConfigError(
                "sets= names each set by its source's name:; drop inputs= and split= "
                "(or give the manifest as one more source)"
            )
        return read_sources(cfg.sets, "sets")
    if cfg.inputs:
        path = Path(cfg.inputs)
        name = cfg.split or path.name.split(".")[0].removeprefix("cuts_")
    elif corpus:
        path = Path(corpus) / "cuts_test.jsonl.gz"
        name = cfg.split or "test"
    else:
        raise ConfigError(f"{run_dir} does not record its corpus: pass inputs=MANIFEST or sets=")
    if not path.is_file():
        raise ConfigError(f"inputs={path} does not exist; pass a lhotse cut manifest")
    return [Source(name, "cuts", (path,))]


def checked_names(sources: list[Source]) -> None:
    """Several sets each get a folder named after them: the names must be plain folder names."""
    if len(sources) == 1:
        return
    for source in sources:
        name = source.name
        if Path(name).name != name or name in (".", "..", SUMMARY_FILE, HYPOTHESES_FILE):
            raise ConfigError(
                f"sets: source name {name!r} cannot name its folder under eval/step_<N>/; "
                "give it a plain name: (no /)"
            )


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
    shape = model_of(model)
    text = text_codec(model, shape.vocab_size)
    dims = layout(cfg, shape, int(os.environ.get("WORLD_SIZE", "1")))
    try:
        normalizer(cfg.normalizer)
        extractor = extractor_of(model.pretrained_encoder)
        sources = sources_of(cfg, corpus, run_dir)
        checked_names(sources)
        check_prompt_tags(sources, model.pretrained_llm, "sets")
        limits = Featurizer(extractor).limits(shape.enc_positions, shape.enc_subsampling)
        checks = check_sources(sources, None, limits, say)
        sets = tuple(EvalSet(check, text.for_tags(check.source.tags)) for check in checks)
    except ValueError as error:  # SourceError, and ConfigError itself, are ValueErrors
        raise ConfigError(str(error)) from None
    return Plan(source, step, shape, extractor, sets, cfg.normalizer, dims)


@dataclass
class Decoded:
    """A set's decoded utterances (one rank's share, or all of them once gathered)."""

    rows: list[dict] = field(default_factory=list)  # id, reference, hypothesis
    audio_s: float = 0.0
    skipped: dict[str, str] = field(default_factory=dict)  # cut id -> why it was not decoded


class Evaluation:
    def __init__(self, cfg: EvaluateConfig, plan: Plan, device: torch.device) -> None:
        self.cfg, self.plan, self.device = cfg, plan, device
        self.rank = dist.get_rank()
        # fp32 throughout: cuDNN's convolutions (the encoder's stem) would otherwise run in TF32
        # on a GPU, and a greedy decode's near-ties would follow the device.
        torch.backends.cudnn.allow_tf32 = False
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
        self.featurize = Featurizer(plan.extractor)
        self.normalize = normalizer(plan.normalizer)

    def batches(self, eval_set: EvalSet) -> tuple[list[list[Cut]], int, list[Cut]]:
        """This rank's batches of the set, how many every rank runs, and the filler a rank
        short of batches decodes and discards (its own first batch, else the set's first)."""
        excluded = eval_set.check.excluded
        usable = (cut for cut in load_source_cuts(eval_set.check.source) if cut.id not in excluded)
        cuts = sorted(usable, key=lambda cut: (cut.duration, cut.id))
        size = self.cfg.batch_size
        batches = [cuts[start : start + size] for start in range(0, len(cuts), size)]
        indices, forwards = rank_share(len(batches), self.dp_rank, self.dp_size)
        mine = [batches[index] for index in indices]
        return mine, forwards, (mine or batches)[0]

    def any_active(self, mine: bool) -> bool:
        flag = torch.tensor([float(mine)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def decode(
        self, cuts: list[Cut], text: ByteTokenizer | ChatPrompt
    ) -> tuple[list[tuple[Cut, str]], dict[str, str]]:
        """(cut, hypothesis) for each cut whose features can be made, and why the others
        cannot be (cut id -> reason); a batch with none left stops the evaluation."""
        features, kept, unusable = [], [], {}
        for cut in cuts:
            try:
                features.append([torch.from_numpy(f) for f in self.featurize.segments(cut)])
                kept.append(cut)
            except BadCut as error:
                unusable[cut.id] = str(error)
        if not kept:
            raise BadCut(f"no cut of a batch can be decoded: {'; '.join(unusable.values())}")
        padded, lens = pad_segments(features, self.featurize.bins)
        prompts = [self.prompt(cut, text) for cut in kept]
        with trapped(self.cfg.device_trap):
            ids = greedy_decode(
                self.model,
                padded.to(self.device),
                lens.to(self.device),
                self.cfg.max_new_tokens,
                self.any_active,
                use_cache=self.cfg.kv_cache,
                batch_multiple=self.plan.dims.tp,
                stages=self.stages,
                prompt=prompts,
                eos_ids=text.eos_ids,
            )
        return [(cut, text.decode(row)) for cut, row in zip(kept, ids, strict=True)], unusable

    @staticmethod
    def prompt(cut: Cut, text: ByteTokenizer | ChatPrompt) -> Encoded:
        """What decoding feeds for ``cut``: its conversation up to its last assistant turn,
        or the set's generation prompt around a speech cut's audio."""
        if conversation_of(cut.custom) is None:
            return text.generation_prompt()
        return encoded(text, cut).up_to_answer()

    def decode_set(self, eval_set: EvalSet) -> tuple[Decoded, float]:
        """This rank's share of the set, decoded, and the seconds it took."""
        mine, forwards, filler = self.batches(eval_set)
        started = time.perf_counter()
        decoded = Decoded()
        for index in range(forwards):
            counts = index < len(mine)
            pairs, unusable = self.decode(mine[index] if counts else filler, eval_set.text)
            if not counts:
                continue
            decoded.skipped.update(unusable)
            decoded.audio_s += sum(cut.duration for cut, _ in pairs)
            decoded.rows += [
                {"id": cut.id, "reference": transcript(cut), "hypothesis": hypothesis}
                for cut, hypothesis in pairs
            ]
            if self.rank == 0:
                say(
                    f"evaluate: {eval_set.name} batch {index + 1}/{forwards} on rank 0 "
                    f"({len(decoded.rows)} utterances)"
                )
        return decoded, time.perf_counter() - started

    def run(self) -> dict | None:
        """Decode every set, then (rank 0) score and write them; rank 0 returns the summary."""
        decoded, elapsed = {}, {}
        for eval_set in self.plan.sets:
            decoded[eval_set.name], elapsed[eval_set.name] = self.decode_set(eval_set)
        gathered: list = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(decoded, gathered, dst=0)
        if self.rank != 0:
            return None
        return self.write(gathered, elapsed)

    def merged(self, gathered: list[dict[str, Decoded]], eval_set: EvalSet) -> Decoded:
        """The set's rows from every rank, once each (TP/EP peers decode the same ones), by id;
        its audio summed over data-parallel ranks; every cut set aside or skipped."""
        by_id: dict[str, dict] = {}
        audio_by_dp: dict[int, float] = {}
        skipped = dict(eval_set.check.excluded)
        for rank, per_set in enumerate(gathered):
            part = per_set[eval_set.name]
            by_id.update({row["id"]: row for row in part.rows})
            audio_by_dp[self.plan.dims.coordinates(rank).dp_rank] = part.audio_s
            skipped.update(part.skipped)
        rows = [by_id[key] for key in sorted(by_id)]
        return Decoded(rows, sum(audio_by_dp.values()), skipped)

    def scored(self, rows: list[dict]) -> ErrorCounts:
        """The rows' edit counts; each row gets both sides as they were scored."""
        counts = ErrorCounts()
        for row in rows:
            row["normalized_reference"] = self.normalize(row["reference"])
            row["normalized_hypothesis"] = self.normalize(row["hypothesis"])
            counts += edit_counts(row["normalized_reference"], row["normalized_hypothesis"])
        return counts

    def write(self, gathered: list[dict[str, Decoded]], elapsed: dict[str, float]) -> dict:
        """Each set's hypotheses and summary; for several sets also the pooled summary."""
        out = Path(self.cfg.run_dir) / EVAL_DIR / step_name(self.plan.step)
        several = len(self.plan.sets) > 1
        summaries: dict[str, dict] = {}
        total, audio_s = ErrorCounts(), 0.0
        for eval_set in self.plan.sets:
            decoded = self.merged(gathered, eval_set)
            counts = self.scored(decoded.rows)
            folder = out / eval_set.name if several else out
            folder.mkdir(parents=True, exist_ok=True)
            with (folder / HYPOTHESES_FILE).open("w", encoding="utf-8") as file:
                for row in decoded.rows:
                    file.write(json.dumps(row) + "\n")
            summary = {
                "split": eval_set.name,
                "inputs": ", ".join(str(path) for path in eval_set.check.source.paths),
                **self.figures(counts, decoded.audio_s, elapsed[eval_set.name]),
                "skipped": decoded.skipped,
            }
            summaries[eval_set.name] = summary
            total, audio_s = total + counts, audio_s + decoded.audio_s
            for cut_id, reason in decoded.skipped.items():
                if cut_id not in eval_set.check.excluded:  # those were reported when checked
                    say(f"evaluate: {eval_set.name}: skipped {reason}")
            say(
                f"evaluate: step {self.plan.step} {eval_set.name}: {describe(summary)}; "
                f"hypotheses in {folder / HYPOTHESES_FILE}"
            )
        if several:
            for name, summary in summaries.items():
                write_summary(out / name, {**self.about(), **summary})
            pooled = {
                "split": ",".join(summaries),
                **self.figures(total, audio_s, sum(elapsed.values())),
                "sets": summaries,
            }
            print_table(summaries, pooled)
        else:
            [pooled] = summaries.values()
        summary = {**self.about(), **pooled}
        write_summary(out, summary)
        return summary

    def about(self) -> dict[str, Any]:
        """What was evaluated, and how."""
        source = self.plan.source
        return {
            "step": self.plan.step,
            "checkpoint": str(source.directory if isinstance(source, Export) else source),
            "layout": self.plan.dims.describe(),
            "kv_cache": self.cfg.kv_cache,
            "batch_size": self.cfg.batch_size,
            "max_new_tokens": self.cfg.max_new_tokens,
            "normalizer": self.plan.normalizer,
        }

    @staticmethod
    def figures(counts: ErrorCounts, audio_s: float, decode_s: float) -> dict[str, Any]:
        """A set's (or the pooled sets') scores and speed: the real-time factor is decoding
        time over audio time, as measured on rank 0 while every rank decoded its share."""
        return {
            **counts.figures(),
            "errors": asdict(counts),
            "utterances_per_s": counts.utterances / decode_s,
            "real_time_factor": decode_s / audio_s if audio_s else None,
            "decode_s": decode_s,
        }


def write_summary(folder: Path, summary: dict) -> None:
    (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")


def cells(summary: dict) -> dict[str, str]:
    """A set's figures as text, by the table's column."""
    rtf = summary["real_time_factor"]
    return {
        "utterances": str(summary["num_utterances"]),
        "words": str(summary["reference_words"]),
        "WER": f"{summary['wer']:.2%}",
        "CER": f"{summary['cer']:.2%}",
        "SER": f"{summary['ser']:.2%}",
        "sub": str(summary["substitutions"]),
        "del": str(summary["deletions"]),
        "ins": str(summary["insertions"]),
        "RTF": "-" if rtf is None else f"{rtf:.3f}",
    }


def describe(summary: dict) -> str:
    """One line of a set's figures."""
    text = cells(summary)
    return (
        f"WER {text['WER']} CER {text['CER']} SER {text['SER']} (S {text['sub']}, D {text['del']}, "
        f"I {text['ins']} of {text['words']} words) over {text['utterances']} utterances, "
        f"RTF {text['RTF']}"
    )


def print_table(summaries: dict[str, dict], pooled: dict) -> None:
    """Every set's figures and the pooled ones (``all``), one row each, on stdout."""
    named = [*summaries.items(), ("all", pooled)]
    rows = [["set", *cells(pooled)], *([name, *cells(summary).values()] for name, summary in named)]
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


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
        else:  # rank 0 says why; the launcher's SIGTERM, which rank 0's exit brings, ends this
            time.sleep(REFUSAL_GRACE_S)
        sys.exit(EXIT_CONFIG)
    device = init_distributed()
    try:
        Evaluation(cfg, plan, device).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    refuse_uncomposable(main)
