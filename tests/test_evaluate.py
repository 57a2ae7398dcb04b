"""train.evaluate: the same hypotheses at every layout, any manifest, several test sets in one
run, clear refusals.

The models decoded here learnt a handful of utterances by heart, so their transcripts depend on
the audio and end with EOS at different steps: a broken audio path under TP, PP or EP, a row cut
at another row's EOS, or a rank that stops early changes what is written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jiwer
import pytest
import yaml
from hydra import compose, initialize_config_module
from lhotse import CutSet
from lhotse.audio import AudioSource
from lhotse.utils import fastcopy
from omegaconf import OmegaConf

from contract.configs import PACKAGED_CONFIGS
from orchestrator.results import latest_evaluation
from tests.harness.chains import launch_json, wait_chain_quietly
from tests.harness.hf_tiny import save_tiny
from tests.harness.models import evaluate, exported, trained_llm_agrees
from tests.harness.process import REPO, run_module, run_tool
from tests.harness.training import TRAPPED_DECODING
from train.config import ConfigError
from train.data.loader import load_cuts
from train.eval.normalizers import whisper_en
from train.evaluate import preflight

MEMORIZED, UNHEARD = 8, 2  # utterances the evaluated models learn by heart, and held-out ones
MEMORIZE_STEPS = 600
BATCH = 2  # utterances per decoding batch: 5 batches, 3 and 2 on two data-parallel ranks


def trained(tmp_path_factory, corpus: Path, name: str, *overrides: str, nproc: int) -> Path:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    result = run_module(
        "train",
        f"run_dir={run_dir}",
        f"data.corpus={corpus}",
        "data.max_duration=8",
        "wandb.mode=disabled",
        "optim.warmup_steps=2",
        *overrides,
        nproc=nproc,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def memorable(tmp_path_factory, corpus) -> Path:
    """A corpus of the session corpus's MEMORIZED shortest training utterances (train and dev
    splits), tested on them and UNHEARD held-out test utterances (its features are shared)."""
    out = tmp_path_factory.mktemp("memorable") / "corpus"
    out.mkdir()
    for shared in ("feats", "wavs"):
        (out / shared).symlink_to(corpus / shared)
    train_cuts = CutSet.from_jsonl_lazy(corpus / "cuts_train.jsonl.gz")
    learnt = sorted(train_cuts, key=lambda cut: (cut.duration, cut.id))[:MEMORIZED]
    unheard = list(CutSet.from_jsonl_lazy(corpus / "cuts_test.jsonl.gz"))[:UNHEARD]
    assert len(unheard) == UNHEARD
    for split in ("train", "dev"):
        CutSet.from_cuts(learnt).to_file(out / f"cuts_{split}.jsonl.gz")
    CutSet.from_cuts(learnt + unheard).to_file(out / "cuts_test.jsonl.gz")
    return out


def memorized(tmp_path_factory, corpus: Path, name: str, *overrides: str) -> Path:
    """A tiny model trained on ``corpus`` (one process) until it transcribes most of it."""
    return trained(
        tmp_path_factory,
        corpus,
        name,
        "data.max_duration=3",
        "data.buckets=1",
        "optim.lr=1e-2",
        "optim.warmup_steps=10",
        f"train.max_steps={MEMORIZE_STEPS}",
        "train.log_every=50",
        f"checkpoint.interval={MEMORIZE_STEPS}",
        *overrides,
        nproc=1,
    )


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, memorable) -> Path:
    return memorized(tmp_path_factory, memorable, "dense")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, memorable) -> Path:
    return memorized(tmp_path_factory, memorable, "moe", "model=tiny_moe")


@pytest.fixture(scope="module")
def dense_alone(dense_run) -> dict:
    return evaluate(dense_run)


def learnt_it(result: dict) -> None:
    """The hypotheses depend on the audio: most learnt utterances come out exactly, in several
    different transcripts of different lengths (so rows of a batch stop at different steps),
    and the unheard ones do not, so the WER is not 0 (nor bounded by 1: a model that learnt eight
    utterances by heart may say a long one for an utterance it never heard)."""
    rows = result["rows"]
    assert len(rows) == MEMORIZED + UNHEARD
    exact = [row for row in rows if row["hypothesis"] == row["reference"]]
    assert len(exact) >= MEMORIZED - 2, rows
    assert len({row["hypothesis"] for row in rows}) >= MEMORIZED // 2 + 1, rows
    assert len({len(row["hypothesis"]) for row in exact}) >= 3, rows
    assert result["summary"]["wer"] > 0, rows


def test_one_process_writes_hypotheses_and_a_summary(dense_run, dense_alone, memorable):
    summary = dense_alone["summary"]
    assert summary["step"] == MEMORIZE_STEPS and summary["split"] == "test"
    assert summary["num_utterances"] == MEMORIZED + UNHEARD
    assert "world=1" in summary["layout"] and summary["kv_cache"] is True
    assert summary["utterances_per_s"] > 0
    learnt_it(dense_alone)
    # The corpus-level rates, recounted from the written rows by jiwer alone.
    rows = dense_alone["rows"]
    references = [row["normalized_reference"] for row in rows]
    hypotheses = [row["normalized_hypothesis"] for row in rows]
    assert summary["wer"] == pytest.approx(jiwer.wer(references, hypotheses), abs=1e-12)
    assert summary["cer"] == pytest.approx(jiwer.cer(references, hypotheses), abs=1e-12)


@pytest.mark.parametrize(
    "overrides", [[], ["parallel.tp=2"], ["parallel.pp=2"]], ids=["dp2", "tp2", "pp2"]
)
def test_the_same_hypotheses_at_another_layout(dense_run, dense_alone, overrides):
    """Saved by one process; decoded at 2 data-parallel ranks (3 and 2 batches of 2), tp 2 and
    in 2 pipeline stages: the same transcripts, each row stopping at its own EOS. Decoded
    under the device trap (train/loop/device_trap.py): a tensor made without its device fails."""
    other = evaluate(dense_run, *overrides, TRAPPED_DECODING, nproc=2)
    assert other["rows"] == dense_alone["rows"]
    assert other["summary"]["wer"] == dense_alone["summary"]["wer"]
    assert "world=2" in other["summary"]["layout"]


def test_the_moe_preset_decodes_the_same_at_ep2(moe_run):
    alone = evaluate(moe_run)
    learnt_it(alone)
    experts = evaluate(moe_run, "parallel.dp_shard=2", "parallel.ep=2", TRAPPED_DECODING, nproc=2)
    assert experts["rows"] == alone["rows"]
    assert "ep=2" in experts["summary"]["layout"]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, memorable) -> tuple[Path, list[str]]:
    """A tiny pretrained Qwen2 (tied head, ChatML template) trained on the memorable corpus in
    a chain of two jobs (the second resumes the first's checkpoint): the run dir and each
    job's log."""
    directory = save_tiny("qwen2", tmp_path_factory.mktemp("qwen2"))
    run_dir = tmp_path_factory.mktemp("chat") / "run"
    logs = []
    for _ in range(2):
        result = run_module(
            "train",
            f"run_dir={run_dir}",
            f"data.corpus={memorable}",
            "wandb.mode=disabled",
            "data.max_duration=3",
            "data.buckets=1",
            "optim.lr=1e-2",
            "optim.warmup_steps=10",
            f"train.max_steps={MEMORIZE_STEPS}",
            f"train.max_steps_per_run={MEMORIZE_STEPS // 2}",
            "train.log_every=50",
            f"checkpoint.interval={MEMORIZE_STEPS // 2}",
            f"model.pretrained_llm={directory}",
            "model.prompt=Write down what is said.",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        logs.append(result.stdout + result.stderr)
    return run_dir, logs


def test_a_pretrained_llm_learns_in_its_chat_template_and_decodes_in_it(chat_run):
    """Examples rendered with the template, the loss on the answer only, decoding after the
    same generation prompt and stopping at the template's end of turn (<|im_end|>): the
    memorized utterances come out exactly, at one process and at tp 2 (vocabulary split
    unevenly, the tied head with it). The weights load once, at the chain's first job."""
    run_dir, (first, second) = chat_run
    assert "LLM weights loaded" in first and "starting fresh" in first
    assert "LLM weights loaded" not in second and "resumed from" in second
    alone = evaluate(run_dir)
    learnt_it(alone)
    split = evaluate(run_dir, "parallel.tp=2", TRAPPED_DECODING, nproc=2)
    assert split["rows"] == alone["rows"]


def test_an_external_manifest_with_audio_only(dense_run, corpus, tmp_path):
    """A CutSet of our own: three dev cuts without their stored features (fbank computed)."""
    cuts = CutSet.from_cuts(list(load_cuts(corpus / "cuts_dev.jsonl.gz"))[:3]).drop_features()
    manifest = tmp_path / "cuts_mine.jsonl.gz"
    cuts.to_file(manifest)
    result = evaluate(with_checkpoints_of(dense_run, tmp_path / "run"), f"inputs={manifest}")
    assert result["summary"]["split"] == "mine"
    assert result["summary"]["num_utterances"] == 3


def with_checkpoints_of(trained_run: Path, run_dir: Path) -> Path:
    """A fresh run dir reading ``trained_run``'s checkpoints, so its eval/ starts empty."""
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(trained_run / "checkpoints")
    return run_dir


def untranscribed(cut):
    """The cut with an empty transcript: a source's cut that checking sets aside."""
    supervisions = [fastcopy(sup, text="") for sup in cut.supervisions]
    return fastcopy(cut, id=f"{cut.id}-untranscribed", supervisions=supervisions)


def unreadable(cut, directory: Path):
    """The cut with its features dropped and its audio file garbage: it passes checking (the
    file exists) and is skipped when decoding finds it unreadable."""
    broken = directory / "broken.wav"
    broken.write_bytes(b"not audio at all")
    cut = cut.drop_features()
    sources = [AudioSource(type="file", channels=[0], source=str(broken))]
    recording = fastcopy(cut.recording, id=f"{cut.recording.id}-broken", sources=sources)
    return fastcopy(cut, id=f"{cut.id}-unreadable", recording=recording)


def test_several_sets_in_one_run(dense_run, memorable, tmp_path):
    """``sets=`` of the learnt and the unheard utterances, decoded at 2 data-parallel ranks in
    one run with Whisper's English normalizer: each set has its own hypotheses and figures, the
    pooled summary's counts are their sums, and the cuts no decoder can use are reported per
    set (one without transcript set aside before decoding, one with garbage audio skipped)."""
    cuts = list(load_cuts(memorable / "cuts_test.jsonl.gz"))
    learnt, unheard = cuts[:MEMORIZED], cuts[MEMORIZED:]
    CutSet.from_cuts(learnt).to_file(tmp_path / "learnt.jsonl.gz")
    extra = [untranscribed(unheard[0]), unreadable(unheard[1], tmp_path)]
    CutSet.from_cuts(unheard + extra).to_file(tmp_path / "unheard.jsonl.gz")
    sets = [
        {"name": "learnt", "cuts": "learnt.jsonl.gz"},
        {"name": "unheard", "cuts": "unheard.jsonl.gz"},
    ]
    (tmp_path / "sets.yaml").write_text(yaml.safe_dump(sets))
    run_dir = with_checkpoints_of(dense_run, tmp_path / "run")
    result = run_module(
        "train.evaluate",
        f"run_dir={run_dir}",
        f"batch_size={BATCH}",
        f"sets={tmp_path / 'sets.yaml'}",
        "normalizer=whisper_en",
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = run_dir / "eval" / f"step_{MEMORIZE_STEPS}"
    pooled = json.loads((out / "summary.json").read_text())
    assert pooled["split"] == "learnt,unheard" and pooled["normalizer"] == "whisper_en"
    assert list(pooled["sets"]) == ["learnt", "unheard"]
    total: dict[str, int] = {}
    for name, expected in (("learnt", learnt), ("unheard", unheard)):
        summary = json.loads((out / name / "summary.json").read_text())
        # The set's own summary: its figures as the pooled one lists them, and the run's.
        assert {key: summary[key] for key in pooled["sets"][name]} == pooled["sets"][name]
        assert (summary["step"], summary["layout"]) == (pooled["step"], pooled["layout"])
        rows = [
            json.loads(line) for line in (out / name / "hypotheses.jsonl").read_text().splitlines()
        ]
        assert sorted(row["id"] for row in rows) == sorted(cut.id for cut in expected)
        assert all(row["normalized_reference"] == whisper_en(row["reference"]) for row in rows)
        references = [row["normalized_reference"] for row in rows]
        hypotheses = [row["normalized_hypothesis"] for row in rows]
        assert summary["wer"] == pytest.approx(jiwer.wer(references, hypotheses), abs=1e-12)
        edits = summary["substitutions"] + summary["deletions"] + summary["insertions"]
        assert summary["wer"] == pytest.approx(edits / summary["reference_words"], abs=1e-12)
        assert summary["num_utterances"] == len(rows) and summary["real_time_factor"] > 0
        for key, value in summary["errors"].items():
            total[key] = total.get(key, 0) + value
    assert pooled["errors"] == total and pooled["num_utterances"] == MEMORIZED + UNHEARD
    assert pooled["sets"]["learnt"]["wer"] < pooled["sets"]["unheard"]["wer"]
    skipped = pooled["sets"]["unheard"]["skipped"]
    assert skipped[extra[0].id] == "empty transcript", skipped
    assert "its audio cannot be read" in skipped[extra[1].id], skipped
    assert pooled["sets"]["learnt"]["skipped"] == {}
    assert not (out / "hypotheses.jsonl").exists()
    lines = result.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("set ")))
    assert lines[header].split()[:5] == ["set", "utterances", "words", "WER", "CER"]
    assert [line.split()[0] for line in lines[header + 1 :]] == ["learnt", "unheard", "all"]
    # What orchestrator status and plot read of it.
    evaluation = latest_evaluation(run_dir)
    assert evaluation.wer == pooled["wer"]
    assert evaluation.sets == {name: s["wer"] for name, s in pooled["sets"].items()}


def test_bad_input_is_one_error_line(dense_run, corpus, tmp_path):
    """Each refusal is one ConfigError line from preflight (checked in this process); the
    command turns one into exit 2 and a single ``error:`` line on every rank's behalf."""
    empty = tmp_path / "empty.jsonl.gz"
    CutSet.from_cuts([]).to_file(empty)
    unlabelled = tmp_path / "unlabelled.jsonl.gz"
    dev = corpus / "cuts_dev.jsonl.gz"
    CutSet.from_cuts([next(iter(load_cuts(dev))).drop_supervisions()]).to_file(unlabelled)
    unusable_set = f"sets=[{{name: mine, cuts: {dev}}}, {{name: silent, cuts: {unlabelled}}}]"
    nested_name = f"sets=[{{name: libri/clean, cuts: {dev}}}, {{name: other, cuts: {dev}}}]"
    cases = [
        ([f"run_dir={tmp_path / 'nothing'}"], "no complete checkpoint"),
        ([f"run_dir={dense_run}", "step=7"], "not a complete checkpoint"),
        ([f"run_dir={dense_run}", f"inputs={tmp_path / 'missing.jsonl.gz'}"], "does not exist"),
        ([f"run_dir={dense_run}", f"inputs={empty}"], "has no usable cuts (it is empty)"),
        ([f"run_dir={dense_run}", f"inputs={unlabelled}"], "{'empty transcript': 1}"),
        ([f"run_dir={dense_run}", f"sets={tmp_path / 'sets.yaml'}"], "sets.yaml: no such file"),
        ([f"run_dir={dense_run}", unusable_set], "source silent (cuts: "),
        ([f"run_dir={dense_run}", unusable_set, f"inputs={empty}"], "drop inputs= and split="),
        ([f"run_dir={dense_run}", nested_name], "'libri/clean' cannot name its folder"),
        ([f"run_dir={dense_run}", "normalizer=whisper"], "choose one of none, basic, whisper_en"),
        ([f"run_dir={dense_run}", "parallel.cp=2"], "context parallelism has nothing to split"),
    ]
    for args, message in cases:
        with initialize_config_module(PACKAGED_CONFIGS.removeprefix("pkg://"), version_base=None):
            raw = compose("evaluate", overrides=args)
        with pytest.raises(ConfigError, match=re.escape(message)) as refused:
            preflight(OmegaConf.to_object(raw))
        assert "\n" not in str(refused.value)
    # A set with no usable cut, at 2 ranks: the source is named once, on rank 0's behalf.
    result = run_module("train.evaluate", f"run_dir={dense_run}", unusable_set, nproc=2)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "source silent" in errors[0], result.stderr[-2000:]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_chain_ends_with_its_evaluation(slurm_cluster, tmp_path, corpus):
    """2 training jobs across the loopback cluster's nodes, then --then recipes/evaluate.yaml:
    it runs after them, scores the newest checkpoint, and status shows the WER."""
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n2",
        "--run-dir",
        str(run_dir),
        "--then",
        "recipes/evaluate.yaml",
        "recipes/train_tiny_2node.yaml",
        "--",
        f"data.corpus={corpus}",
        "data.max_duration=8",
        "wandb.mode=disabled",
        "train.max_steps=4",
        "train.max_steps_per_run=2",
        cwd=REPO,
    )
    written = run_dir / "eval" / "step_4" / "summary.json"
    final = wait_chain_quietly(run_dir, summary["chain_id"], timeout=400)
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 3, final
    assert [job["then"] for job in final["jobs"]] == [False, False, True]
    result = json.loads(written.read_text())
    assert result["split"] == "test" and result["num_utterances"] > 0
    status = run_tool("orchestrator", "status", summary["chain_id"])
    assert f"WER {100 * result['wer']:.2f}% at step 4" in status.stdout, status.stdout


def test_an_exported_pretrained_llm_is_what_trained_with_its_tokenizer(chat_run, tmp_path):
    """``python -m train.export``: AutoModelForCausalLM and AutoTokenizer load DIR/llm offline;
    the logits are the trained LLM's; the tokenizer keeps <|audio|> and renders the same prompt
    as training did; the audio side sits beside it, and its config names the LLM folder."""
    from train.data.prompt import AUDIO_TOKEN, ChatPrompt, load_tokenizer
    from train.export import LLM_DIR, SPEECH_CONFIG, SPEECH_WEIGHTS

    run_dir, _ = chat_run
    out = tmp_path / "export"
    done = exported(run_dir, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the model in fp32 on the CPU takes" in done.stderr
    trained_llm_agrees(run_dir, out / LLM_DIR)
    config = json.loads((out / SPEECH_CONFIG).read_text())
    assert config["model"]["pretrained_llm"] == LLM_DIR and config["audio_token"] == AUDIO_TOKEN
    assert (out / SPEECH_WEIGHTS).is_file() and (out / LLM_DIR / "generation_config.json").is_file()
    tokenizer = load_tokenizer(out / LLM_DIR)
    assert len(tokenizer.encode(AUDIO_TOKEN, add_special_tokens=False)) == 1
    state = json.loads(next((run_dir / "checkpoints").glob("step_*/state.json")).read_text())
    original = load_tokenizer(Path(state["trainer_state"]["model"]["pretrained_llm"]))
    prompt = config["model"]["prompt"]
    assert prompt == "Write down what is said."
    exported_prompt = ChatPrompt(tokenizer, prompt, None).generation_prompt()
    assert exported_prompt == ChatPrompt(original, prompt, None).generation_prompt()


def test_a_preset_exports_as_a_llama(dense_run, dense_alone, tmp_path):
    """A preset's decoder (our blocks) loads as LlamaForCausalLM with the same logits, and
    train.evaluate decodes the export (read sharded at dp 2) as it decodes the checkpoint."""
    from train.export import LLM_DIR

    out = tmp_path / "export"
    done = exported(dense_run, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / LLM_DIR / "config.json").read_text())["model_type"] == "llama"
    trained_llm_agrees(dense_run, out / LLM_DIR)
    assert evaluate(out, nproc=2)["rows"] == dense_alone["rows"]


def test_an_export_that_cannot_be_done_is_one_line_and_writes_nothing(
    dense_run, moe_run, tmp_path, capsys
):
    """Each refusal of ``python -m train.export``'s main (called here, in this process; the
    command's exit status 2 from a refusal: tests/test_lora.py) is one ``error:`` line and
    status 2, and nothing is written."""
    from train.export import main

    existing = tmp_path / "taken"
    existing.mkdir()
    for run_dir, out, args, message in [
        (dense_run, existing, (), "already exists; give a new directory"),
        (dense_run, tmp_path / "a", ("--step", "7"), "is not a complete checkpoint"),
        (moe_run, tmp_path / "b", (), "an MoE LLM (4 experts) has no Hugging Face family"),
        (tmp_path / "nothing", tmp_path / "c", (), "no complete checkpoint"),
    ]:
        status = main([str(run_dir), "--out", str(out), *args])
        stderr = capsys.readouterr().err
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert status == 2 and len(errors) == 1 and message in errors[0], stderr
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and not any(existing.iterdir())


def test_an_audio_token_beyond_the_vocabulary_gets_a_mean_row():
    """A tokenizer whose <|audio|> lies past config.json's vocab_size (Llama 3's does): the
    exported embedding (and an untied head) grows by the trained rows' mean, so transformers
    loads a consistent model; a tied head is the embedding and is not written twice."""
    import torch

    from train.export import with_rows

    embed = torch.arange(8.0).reshape(4, 2)
    grown = with_rows({"model.embed_tokens.weight": embed, "lm_head.weight": -embed}, 5, False)
    assert grown["model.embed_tokens.weight"].tolist()[-1] == [3.0, 4.0]
    assert grown["lm_head.weight"].tolist()[-1] == [-3.0, -4.0]
    tied = with_rows({"model.embed_tokens.weight": embed}, 6, True)
    assert list(tied) == ["model.embed_tokens.weight"] and tied[
        "model.embed_tokens.weight"
    ].shape == (6, 2)
