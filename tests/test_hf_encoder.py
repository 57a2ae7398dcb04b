"""Pretrained Hugging Face speech encoders (Whisper, Parakeet) as the SALM's encoder: tiny random
checkpoints that ``transformers`` builds and ``save_pretrained`` writes (nothing downloaded), in
the four ways real ones hold the encoder (tests/harness/hf_tiny.py), loaded by prefix and held to
``transformers``' own outputs, to the length arithmetic, to the planner's inventory, under FSDP2
and pipeline stages against one process, compiled against eager, and through an export."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    ParakeetEncoder,
    ParakeetForCTC,
    WhisperForConditionalGeneration,
    WhisperModel,
)

from tests.harness.hf_tiny import ENCODER_KINDS, save_tiny_encoder
from tests.harness.process import REPO, run_python
from tests.harness.workers.hf_encoder_worker import record, varied_batch
from train.checkpoint.manager import CheckpointManager
from train.config import ModelConfig, TrainConfig
from train.export import main as export_main
from train.exported import ENCODER_DIR, load_export, read_export
from train.flops import loss_recompute_flops, step_flops
from train.loop.step import WholeModelRunner
from train.models.batch import Batch
from train.models.build import build_model, freeze_parameters
from train.models.compiled import graph_counts
from train.models.hf_encoder import transformers_class
from train.models.hf_encoder_config import encoder_fields
from train.models.hf_weights import encoder_state, load_encoder_weights
from train.models.inventory import inventory
from train.models.loss import loss_targets
from train.models.parallelize import apply_compile
from train.models.salm import SALM, length_mask
from train.models.shape import audio_positions, encoder_frames
from train.parallel.dims import ParallelDims
from train.parallel.layout import frozen_of, model_of

WORKER = REPO / "tests" / "harness" / "workers" / "hf_encoder_worker.py"
CPU = torch.device("cpu")
# Where each kind of checkpoint keeps the encoder's tensors.
PREFIXES = {
    "whisper": "model.encoder.",
    "whisper_model": "encoder.",
    "parakeet": "",
    "parakeet_ctc": "encoder.",
}
TRANSFORMERS = {
    "whisper": lambda d: WhisperForConditionalGeneration.from_pretrained(d).get_encoder(),
    "whisper_model": lambda d: WhisperModel.from_pretrained(d).encoder,
    "parakeet": ParakeetEncoder.from_pretrained,
    "parakeet_ctc": lambda d: ParakeetForCTC.from_pretrained(d).encoder,
}
WHISPER_KINDS, PARAKEET_KINDS = ["whisper", "whisper_model"], ["parakeet", "parakeet_ctc"]


@pytest.fixture(scope="session")
def encoders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {kind: save_tiny_encoder(kind, root / kind) for kind in ENCODER_KINDS}


def loaded(directory: Path, stride: int = 1) -> SALM:
    """The tiny preset's SALM with ``directory``'s encoder, built as the trainer builds (meta
    device, materialized, initialized) and the encoder loaded, in eval mode."""
    model = build_model(
        model_of(ModelConfig(pretrained_encoder=str(directory), projector_stride=stride)), CPU, 0
    )
    load_encoder_weights(model, directory)
    return model.eval()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the largest value of ``want``."""
    return float((got - want).abs().max() / want.abs().max())


def padded(lens: list[int], bins: int = 80) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-padded random features of ``lens`` frames and their lengths."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor(lens)
    features = torch.randn(len(lens), max(lens), bins, generator=g)
    return features * length_mask(lengths, max(lens))[..., None], lengths


@pytest.mark.parametrize("kind", WHISPER_KINDS)
@torch.no_grad()
def test_whisper_equals_transformers_on_a_full_window(encoders, kind) -> None:
    """transformers' WhisperEncoder takes exactly 3000 frames (30 s): on those, ours is its
    computation."""
    ours = loaded(encoders[kind])
    theirs = TRANSFORMERS[kind](encoders[kind]).eval()
    features, lens = padded([3000, 3000])
    want = theirs(features.transpose(1, 2)).last_hidden_state
    got, got_lens = ours.encoder(features, lens)
    assert got_lens.tolist() == [1500, 1500]
    assert relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("kind", PARAKEET_KINDS)
@torch.no_grad()
def test_parakeet_equals_transformers_padded_and_alone(encoders, kind) -> None:
    """transformers' ParakeetEncoder runs any length, and a padded batch with its attention
    mask: ours equals it on every real frame of both."""
    ours = loaded(encoders[kind])
    theirs = TRANSFORMERS[kind](encoders[kind]).eval()
    features, lens = padded([203, 150, 77])
    out = theirs(features, attention_mask=length_mask(lens, features.shape[1]).long())
    got, got_lens = ours.encoder(features, lens)
    assert got_lens.tolist() == out.attention_mask.sum(-1).tolist()
    real = out.attention_mask.bool()
    assert relative_error(got[real], out.last_hidden_state[real]) <= 1e-5
    for index, length in enumerate(lens.tolist()):
        alone = theirs(features[index : index + 1, :length]).last_hidden_state
        mine, _ = ours.encoder(features[index : index + 1, :length], lens[index : index + 1])
        assert relative_error(mine, alone) <= 1e-5


@pytest.mark.parametrize("kind", ["whisper", "parakeet"])
@torch.no_grad()
def test_padding_changes_no_audio_position_and_lengths_are_the_arithmetic(encoders, kind) -> None:
    """Through encoder and projector (3 frames stacked per position, the last group of each
    example short): every example's audio positions in a padded batch are its positions alone,
    and their count is ``audio_positions`` of its frames."""
    model = loaded(encoders[kind], stride=3)
    features, lens = padded([1000, 333, 57, 5])
    batch, batch_lens = model.projector(*model.encoder(features, lens))
    assert batch_lens.tolist() == audio_positions(model.cfg, lens).tolist()
    assert batch.shape[1] == max(audio_positions(model.cfg, n) for n in lens.tolist())
    for index, length in enumerate(lens.tolist()):
        one = features[index : index + 1, :length], lens[index : index + 1]
        alone, alone_lens = model.projector(*model.encoder(*one))
        assert alone.shape[1] == alone_lens.item() == batch_lens[index]
        assert relative_error(batch[index, : alone.shape[1]], alone[0]) <= 1e-5
        assert encoder_frames(model.cfg, length) == model.encoder(*one)[0].shape[1]


@pytest.mark.parametrize("kind", sorted(ENCODER_KINDS))
def test_every_file_tensor_lands_bitwise_under_its_prefix(encoders, kind) -> None:
    """The encoder's tensors in the files, under whichever prefix the checkpoint uses, are the
    model's ``encoder.`` parameters, the frozen ones (Whisper's position table, Parakeet's
    batch-norm statistics) included; nothing of the encoder is left out."""
    model = loaded(encoders[kind])
    stored = load_file(encoders[kind] / "model.safetensors")
    prefix = PREFIXES[kind]
    ours = encoder_state(model, prefix)
    # What BatchNorm counts in training mode is no weight (the statistics stay frozen).
    stored_encoder = {
        name for name in stored if name.startswith(prefix) and "num_batches" not in name
    }
    assert ours.keys() == stored_encoder
    for name, tensor in ours.items():
        assert torch.equal(tensor, stored[name]), name


@pytest.mark.parametrize("kind", ["whisper", "parakeet"])
def test_step_flops_match_pytorchs_flop_counter(encoders, kind) -> None:
    """As for the presets (tests/test_fast_path.py), attention in the math backend so that the
    counter sees its matmuls: within 5% (ours counts the first convolution's input gradient,
    never computed, and no elementwise work), with the head's logits computed again by the
    loss's backward."""
    model = loaded(encoders[kind], stride=2).train()
    model.seq_multiple = 1  # no padding: the counter sees exactly the real positions
    features, feature_lens = padded([403])
    token_lens, tokens = torch.tensor([37]), torch.randint(0, 256, (1, 37))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(Batch(features, feature_lens, tokens, token_lens)).nll_sum.backward()
    positions = audio_positions(model.cfg, feature_lens) + token_lens
    counted = step_flops(model.cfg, feature_lens, token_lens)
    counted += loss_recompute_flops(model.cfg, positions)
    ratio = float(counted) / counter.get_total_flops()
    assert 0.95 <= ratio <= 1.05, ratio


@pytest.mark.parametrize("kind", ["whisper", "parakeet_ctc"])
def test_the_inventory_lists_the_model_exactly(encoders, kind) -> None:
    """The planner prices what the trainer builds: names, shapes, and which tensors never train."""
    cfg = model_of(ModelConfig(pretrained_encoder=str(encoders[kind]), projector_stride=2))
    with torch.device("meta"):
        model = SALM(cfg)
    listed = [(t.name, t.shape, t.trainable) for t in inventory(cfg)]
    built = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    assert listed == built
    assert sum(not trainable for *_, trainable in listed) == (1 if "whisper" in kind else 4)


def test_freezing_the_encoder_by_name(encoders) -> None:
    """``model.freeze`` patterns reach the encoder under its transformers names; its
    untrainable tensors are frozen whatever the patterns say."""
    directory = str(encoders["parakeet_ctc"])
    names = [t.name for t in inventory(model_of(ModelConfig(pretrained_encoder=directory)))]
    encoder = {name for name in names if name.startswith("encoder.")}
    untrainable = {name for name in encoder if ".running_" in name}
    plain = TrainConfig(model=ModelConfig(pretrained_encoder=directory))
    assert frozen_of(plain) == untrainable
    frozen = TrainConfig(model=ModelConfig(pretrained_encoder=directory, freeze=[r"encoder\..*"]))
    assert frozen_of(frozen) == encoder
    convs = ModelConfig(pretrained_encoder=directory, freeze=[r"\.conv\."], unfreeze=["norm"])
    assert (
        frozen_of(TrainConfig(model=convs))
        == {name for name in encoder if ".conv." in name and "norm" not in name} | untrainable
    )
    model = loaded(encoders["parakeet_ctc"])
    trainable = freeze_parameters(model, frozen_of(frozen))
    assert sum(p.numel() for p in trainable) == sum(
        p.numel() for name, p in model.named_parameters() if not name.startswith("encoder.")
    )


@pytest.mark.parametrize("kind", ["whisper", "parakeet"])
def test_compiled_blocks_train_as_eager_on_varying_batches(encoders, kind) -> None:
    """The pretrained encoder's blocks compiled with ``fullgraph=True`` (no graph break), their
    batch and length dimensions dynamic: batches of other sizes and lengths, including one
    utterance, train through train.loop.step's runner as eager does, on one graph per grad mode and
    batch of one or more."""
    torch._dynamo.reset()
    compiled, eager = loaded(encoders[kind], stride=2), loaded(encoders[kind], stride=2)
    encoder = compiled.encoder
    apply_compile(encoder.layers, "encoder_block", encoder.block_dims, "aot_eager")
    features, lens, tokens, token_lens = varied_batch(compiled.cfg.n_mels)[:4]
    seen = []
    for model in (compiled, eager):
        runner, sums = WholeModelRunner(model.train(), CPU), []
        for rows in (slice(0, 4), slice(1, 4), slice(2, 3)):
            batch = Batch(features[rows], lens[rows], tokens[rows], token_lens[rows])
            targets = loss_targets(batch.token_lens).float()
            sequences = torch.tensor(float(len(batch.token_lens)))
            sums.append(runner.forward_backward([batch], targets, sequences, 1))
        seen.append(sums + [p.grad for p in model.parameters() if p.grad is not None])
    for got, want in zip(*seen, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert graph_counts()["encoder_block"] == 2  # batches of several, and the batch of one


def test_fsdp_and_pipeline_stages_load_and_train_as_one_process(encoders, tmp_path) -> None:
    """FSDP2 over two ranks, and two pipeline stages (the second holding no encoder), each rank
    reading its shards: the same weights bitwise, the same loss, and one step moves every
    trainable parameter alike and no frozen one."""
    directories = [encoders["whisper"], encoders["parakeet_ctc"]]
    command = [str(WORKER), "--out", str(tmp_path / "out.pt"), *map(str, directories)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = run_python(command, 2, env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded_under = torch.load(tmp_path / "out.pt")
    for directory in directories:
        want = record(directory, ParallelDims(1), stride=2)
        frozen = {
            name for name in want["params"] if "running_" in name or "embed_positions" in name
        }
        moved = {
            name
            for name, param in want["params"].items()
            if not torch.equal(param, want["params_after_step"][name])
        }
        assert moved == want["params"].keys() - frozen, directory
        for layout, results in loaded_under.items():
            got = results[str(directory)]
            for name, param in want["params"].items():
                assert torch.equal(got["params"][name], param), f"{layout}: {name}"
                torch.testing.assert_close(
                    got["params_after_step"][name],
                    want["params_after_step"][name],
                    rtol=1e-4,
                    atol=1e-5,
                    msg=f"{layout}: {name}",
                )
            torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=0)
            torch.testing.assert_close(
                got["loss_after_step"], want["loss_after_step"], rtol=1e-5, atol=0
            )
        fsdp = loaded_under["fsdp"][str(directory)]["local_elements"]
        assert fsdp <= 0.55 * want["local_elements"], "a rank holds the whole encoder"


def saved_run(run_dir: Path, model: SALM, model_cfg: ModelConfig) -> None:
    """A checkpoint of ``model`` as the trainer writes one (its state records the model)."""
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = {"step": 3, "model": dataclasses.asdict(model_cfg), "corpus": None}
    CheckpointManager(run_dir).save(3, model, optimizer, scheduler, state)


@pytest.mark.parametrize("kind", ["whisper", "parakeet_ctc"])
def test_an_export_writes_the_encoder_for_transformers_and_reloads(encoders, tmp_path, kind):
    """The export's encoder/ is a transformers directory of the encoder alone (whose outputs are
    the trained model's), its feature extractor beside it; the export reloads (read_export,
    load_export) into the model it came from, and is itself a ``model.pretrained_encoder``."""
    model_cfg = ModelConfig(pretrained_encoder=str(encoders[kind]), projector_stride=2)
    model = loaded(encoders[kind], stride=2)
    with torch.no_grad():  # a trained encoder: not its files any more
        for param in model.encoder.parameters():
            param.add_(0.01)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        saved_run(tmp_path / "run", model, model_cfg)
    finally:
        dist.destroy_process_group()
    out = tmp_path / "out"
    assert export_main([str(tmp_path / "run"), "--out", str(out)]) == 0
    encoder_dir = out / ENCODER_DIR
    assert {p.name for p in encoder_dir.iterdir()} == {
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
    }
    assert json.loads((out / "speech_config.json").read_text())["encoder_dir"] == ENCODER_DIR
    assert not any(name.startswith("encoder.") for name in load_file(out / "speech.safetensors"))
    family = model.cfg.encoder
    theirs, report = transformers_class(family).from_pretrained(
        encoder_dir, output_loading_info=True
    )
    assert not any(report.values()), report  # no key missing, unexpected or mismatched
    theirs.eval()
    frames = 3000 if family == "whisper" else 240
    features, lens = padded([frames])
    with torch.no_grad():
        got, _ = model.encoder(features, lens)
        inputs = features.transpose(1, 2) if family == "whisper" else features
        assert relative_error(got, theirs(inputs).last_hidden_state) <= 1e-5
    export = read_export(out)
    assert encoder_fields(export.model.pretrained_encoder)["encoder"] == family
    reloaded = build_model(model_of(export.model), CPU, 1)
    load_export(reloaded, export)
    params = dict(model.named_parameters())
    for name, param in reloaded.named_parameters():
        assert torch.equal(param, params[name]), name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model_type": "wav2vec2"},
            r"model_type 'wav2vec2'\) is not supported; supported: whisper, parakeet_encoder",
        ),
        ({"subsampling_conv_kernel_size": 5}, "kernel 5 and stride 2 are not supported"),
    ],
)
def test_an_encoder_the_arithmetic_does_not_cover_is_refused(encoders, tmp_path, change, message):
    for item in encoders["parakeet"].iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message) as error:
        encoder_fields(tmp_path)
    assert "\n" not in str(error.value)


def test_a_hub_id_or_missing_weights_are_refused_in_one_line(encoders, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"model.pretrained_encoder=openai/whisper-small: looks"):
        encoder_fields("openai/whisper-small")
    (tmp_path / "config.json").write_bytes((encoders["whisper"] / "config.json").read_bytes())
    with pytest.raises(ValueError, match="no safetensors weights"):
        encoder_fields(tmp_path)


def test_whisper_refuses_more_than_thirty_seconds(encoders) -> None:
    model = loaded(encoders["whisper"])
    with pytest.raises(ValueError, match="at most 3000 feature frames"):
        model.encoder(*padded([3001]))
