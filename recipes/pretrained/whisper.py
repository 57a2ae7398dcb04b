"""Whisper from CTranslate2's format (``WhisperSpec`` revision 3) to transformers'
``WhisperForConditionalGeneration``, and the checks of a conversion against ``ctranslate2``.

Names map one to one: ``self_attention/linear_0`` is q|k|v fused (Whisper's k projection has no
bias; CTranslate2 stores a zero one, checked and dropped), cross-attention's ``linear_0`` is q and
``linear_1`` k|v fused, the last linear of each attention is ``out_proj``, ``ffn/linear_0/1``
are ``fc1/fc2``, a layer norm's gamma/beta are weight/bias, ``position_encodings/encodings`` is
``embed_positions.weight``; the output projection is an alias of the decoder's embeddings
(tied, as in transformers). Weights are kept in fp32 (the source is fp16, so fp32 holds it
exactly; the trainer's parameters are fp32).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from recipes.pretrained.ct2 import CT2Model, read_model

SPEC, REVISION = "WhisperSpec", 3
START_OF_TRANSCRIPT, NO_TIMESTAMPS, END_OF_TEXT = 50257, 50362, 50256
# tiny.en's decoder prompt: transcribe in English without timestamps.
DECODER_PROMPT = (START_OF_TRANSCRIPT, NO_TIMESTAMPS)
MAX_TARGET_POSITIONS = 448


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32))


def _linear(state: dict, hf: str, ct2: dict, name: str, bias: bool = True) -> None:
    state[f"{hf}.weight"] = _tensor(ct2[f"{name}/weight"])
    if bias:
        state[f"{hf}.bias"] = _tensor(ct2[f"{name}/bias"])


def _norm(state: dict, hf: str, ct2: dict, name: str) -> None:
    state[f"{hf}.weight"] = _tensor(ct2[f"{name}/gamma"])
    state[f"{hf}.bias"] = _tensor(ct2[f"{name}/beta"])


def _split(state: dict, hf: str, parts: tuple[str, ...], ct2: dict, name: str) -> None:
    """A fused projection ``name`` split evenly into ``parts`` (q, k, v): k takes no bias."""
    weights = np.split(ct2[f"{name}/weight"], len(parts))
    biases = np.split(ct2[f"{name}/bias"], len(parts))
    for part, weight, bias in zip(parts, weights, biases, strict=True):
        state[f"{hf}.{part}_proj.weight"] = _tensor(weight)
        if part == "k":
            if np.any(bias):
                raise ValueError(f"{name}: a non-zero k bias, which Whisper's k_proj cannot hold")
            continue
        state[f"{hf}.{part}_proj.bias"] = _tensor(bias)


def _layer(state: dict, hf: str, ct2: dict, name: str, cross: bool) -> None:
    _split(state, f"{hf}.self_attn", ("q", "k", "v"), ct2, f"{name}/self_attention/linear_0")
    _linear(state, f"{hf}.self_attn.out_proj", ct2, f"{name}/self_attention/linear_1")
    _norm(state, f"{hf}.self_attn_layer_norm", ct2, f"{name}/self_attention/layer_norm")
    if cross:
        _linear(state, f"{hf}.encoder_attn.q_proj", ct2, f"{name}/attention/linear_0")
        _split(state, f"{hf}.encoder_attn", ("k", "v"), ct2, f"{name}/attention/linear_1")
        _linear(state, f"{hf}.encoder_attn.out_proj", ct2, f"{name}/attention/linear_2")
        _norm(state, f"{hf}.encoder_attn_layer_norm", ct2, f"{name}/attention/layer_norm")
    _linear(state, f"{hf}.fc1", ct2, f"{name}/ffn/linear_0")
    _linear(state, f"{hf}.fc2", ct2, f"{name}/ffn/linear_1")
    _norm(state, f"{hf}.final_layer_norm", ct2, f"{name}/ffn/layer_norm")


def _layers(ct2: dict, side: str) -> int:
    """How many blocks ``side`` has (``layer_<i>``; ``layer_norm`` is not one)."""
    return len({n.split("/")[1] for n in ct2 if re.match(rf"{side}/layer_\d+/", n)})


def hf_state(model: CT2Model) -> dict[str, torch.Tensor]:
    """transformers' state dict (fp32) of the Whisper in ``model``."""
    if (model.spec, model.revision) != (SPEC, REVISION):
        raise ValueError(f"a {model.spec} revision {model.revision}, expected {SPEC} {REVISION}")
    ct2 = model.variables
    state: dict[str, torch.Tensor] = {}
    for side in ("encoder", "decoder"):
        hf = f"model.{side}"
        state[f"{hf}.embed_positions.weight"] = _tensor(ct2[f"{side}/position_encodings/encodings"])
        _norm(state, f"{hf}.layer_norm", ct2, f"{side}/layer_norm")
        for i in range(_layers(ct2, side)):
            _layer(state, f"{hf}.layers.{i}", ct2, f"{side}/layer_{i}", cross=side == "decoder")
    for conv in ("conv1", "conv2"):
        _linear(state, f"model.encoder.{conv}", ct2, f"encoder/{conv}")
    state["model.decoder.embed_tokens.weight"] = _tensor(ct2["decoder/embeddings/weight"])
    if not np.array_equal(ct2["decoder/projection/weight"], ct2["decoder/embeddings/weight"]):
        raise ValueError("the output projection is not the embeddings: an untied Whisper")
    return state


def whisper_config(model: CT2Model, source_config: dict):
    """transformers' WhisperConfig of ``model`` (shapes from its tensors, heads from its specs),
    with tiny.en's special tokens and the source's token suppression."""
    from transformers import WhisperConfig

    ct2 = model.variables
    vocab, width = ct2["decoder/embeddings/weight"].shape
    return WhisperConfig(
        vocab_size=int(vocab),
        num_mel_bins=int(ct2["encoder/conv1/weight"].shape[1]),
        d_model=int(width),
        encoder_layers=_layers(ct2, "encoder"),
        decoder_layers=_layers(ct2, "decoder"),
        encoder_attention_heads=int(ct2["encoder/num_heads"]),
        decoder_attention_heads=int(ct2["decoder/num_heads"]),
        encoder_ffn_dim=int(ct2["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(ct2["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(ct2["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(ct2["decoder/position_encodings/encodings"].shape[0]),
        bos_token_id=START_OF_TRANSCRIPT,
        decoder_start_token_id=START_OF_TRANSCRIPT,
        eos_token_id=END_OF_TEXT,
        pad_token_id=END_OF_TEXT,
        suppress_tokens=list(source_config["suppress_ids"]),
        begin_suppress_tokens=list(source_config["suppress_ids_begin"]),
        tie_word_embeddings=True,
    )


def generation_config(config):
    """Greedy English transcription without timestamps, as tiny.en decodes."""
    from transformers import GenerationConfig

    return GenerationConfig(
        decoder_start_token_id=START_OF_TRANSCRIPT,
        bos_token_id=START_OF_TRANSCRIPT,
        eos_token_id=END_OF_TEXT,
        pad_token_id=END_OF_TEXT,
        no_timestamps_token_id=NO_TIMESTAMPS,
        suppress_tokens=config.suppress_tokens,
        begin_suppress_tokens=config.begin_suppress_tokens,
        is_multilingual=False,
        max_length=MAX_TARGET_POSITIONS,
        num_beams=1,
        do_sample=False,
    )


def convert(source_dir: Path, out: Path) -> None:
    """Write ``out``: the model (fp32 safetensors, config, generation config), Whisper's feature
    extractor (``preprocessor_config.json``: in transformers 5 a processor saves none) and the
    source's tokenizer."""
    from transformers import (
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizerFast,
    )

    model = read_model(source_dir / "model.bin")
    config = whisper_config(model, json.loads((source_dir / "config.json").read_text()))
    with torch.device("meta"):
        whisper = WhisperForConditionalGeneration(config)
    whisper.load_state_dict(hf_state(model), strict=False, assign=True)
    whisper.tie_weights()
    missing = [n for n, p in whisper.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"the conversion left {missing[0]} (and {len(missing) - 1} more) unset")
    whisper.generation_config = generation_config(config)
    whisper.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=config.num_mel_bins).save_pretrained(out)
    WhisperTokenizerFast(tokenizer_file=str(source_dir / "tokenizer.json")).save_pretrained(out)


# The conversion check's speech: sentences of the project corpus's generator, spoken by espeak-ng.
CHECK_UTTERANCES, CHECK_SEED = 8, 7
# The converted encoder against CTranslate2's on 30-s features, on the frames that hold each
# sentence (the frames the trainer uses: it runs the encoder at the actual length): at most this
# share of their largest output value apart (measured 3e-6 of it). The frames of the window's
# silent padding differ more and from run to run (up to 7e-5 of the largest), so they are
# reported, not held to it.
ENCODER_TOLERANCE = 2e-5


def check_speech(out: Path, workdir: Path) -> tuple[list[str], np.ndarray, list[int]]:
    """Texts, Whisper features (B, 80, 3000) and how many encoder frames hold each of the
    check's sentences, spoken into ``workdir``, by the feature extractor the conversion wrote
    into ``out``."""
    from lhotse import Recording
    from transformers import WhisperFeatureExtractor

    from recipes.make_corpus import check_tools, plan_utterances, synthesize

    check_tools()
    utterances = plan_utterances(CHECK_UTTERANCES, CHECK_SEED)
    audio = []
    for utterance in utterances:
        path = workdir / f"{utterance.utt_id}.wav"
        synthesize(utterance, path)
        audio.append(Recording.from_file(path).load_audio()[0])
    extractor = WhisperFeatureExtractor.from_pretrained(out)
    features = extractor(
        audio,
        sampling_rate=extractor.sampling_rate,
        return_tensors="np",
        return_attention_mask=True,
    )
    frames = [(int(mask.sum()) + 1) // 2 for mask in features.attention_mask]  # conv2 halves
    return [u.text for u in utterances], features.input_features, frames


@torch.no_grad()
def check(out: Path, source_dir: Path, workdir: Path) -> list[str]:
    """The converted Whisper in ``out`` against ``ctranslate2`` running ``source_dir``: encoder
    outputs on the speech within ``ENCODER_TOLERANCE`` of the largest, greedy transcripts token
    for token.
    Returns the findings as lines; raises on the first that fails."""
    import ctranslate2
    from transformers import WhisperForConditionalGeneration, WhisperTokenizerFast

    texts, features, frames = check_speech(out, workdir)
    reference = ctranslate2.models.Whisper(str(source_dir), device="cpu", compute_type="float32")
    stored = ctranslate2.StorageView.from_array(np.ascontiguousarray(features))
    expected = np.array(reference.encode(stored, to_cpu=True))
    model = WhisperForConditionalGeneration.from_pretrained(out).eval()
    encoded = model.model.encoder(torch.from_numpy(features)).last_hidden_state.numpy()
    apart = np.abs(encoded - expected)
    speech = [(apart[i, :n].max(), np.abs(expected[i, :n]).max()) for i, n in enumerate(frames)]
    difference, largest = (float(max(values)) for values in zip(*speech, strict=True))
    if difference > ENCODER_TOLERANCE * largest:
        raise ValueError(
            f"encoder outputs on speech differ from ctranslate2's by {difference:.3g} (largest "
            f"{largest:.3g})"
        )
    prompts = [list(DECODER_PROMPT)] * len(texts)
    theirs = [r.sequences_ids[0] for r in reference.generate(stored, prompts, beam_size=1)]
    ours = [
        [t for t in row if t != END_OF_TEXT]
        for row in model.generate(torch.from_numpy(features)).tolist()
    ]
    tokenizer = WhisperTokenizerFast.from_pretrained(out)
    for text, mine, reference_ids in zip(texts, ours, theirs, strict=True):
        if mine != reference_ids:
            raise ValueError(
                f"{text!r}: greedy transcript {tokenizer.decode(mine)!r}, ctranslate2's "
                f"{tokenizer.decode(reference_ids)!r}"
            )
    return [
        f"encoder on {len(texts)} espeak-ng sentences: max |d| {difference:.2g} on their frames "
        f"against ctranslate2 {ctranslate2.__version__} (largest value {largest:.3g}; "
        f"{float(apart.max()):.2g} over the whole 30-s window, its padding)",
        f"greedy transcripts of the {len(texts)} sentences equal ctranslate2's token for token",
    ]
