"""A pretrained Hugging Face audio encoder's shape, read from its ``config.json`` with plain json
(no torch, no transformers), so that the trainer, its preflight and the planner agree on it.

``model.pretrained_encoder`` names a local directory made by ``save_pretrained`` (or fetched
beforehand), with its feature extractor's ``preprocessor_config.json`` beside it. Families
(``train/models/hf_encoder.py`` runs them):

- Whisper (model_type ``whisper``): the encoder of a WhisperModel or
  WhisperForConditionalGeneration, or a saved WhisperEncoder;
- Parakeet (FastConformer): a saved ParakeetEncoder (``parakeet_encoder``) or the encoder of a
  ParakeetForCTC (``parakeet_ctc``, which nests it as ``encoder_config``).

Options the length arithmetic (``train.models.shape.audio_positions``) does not cover are
refused with one line, never ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models.hf_config import check_directory, model_family, read_config

KEY = "model.pretrained_encoder"
# config.json's model_type -> the encoder family.
FAMILIES = {"whisper": "whisper", "parakeet_encoder": "parakeet", "parakeet_ctc": "parakeet"}
# Parameters of Parakeet's attention that no layer type holds: its content and position biases.
PARAKEET_ATTENTION_BIASES = ("bias_u", "bias_v")


# SALMConfig field -> the family's config.json key, for the encoder's shape.
SHAPE_KEYS = {
    "whisper": {
        "n_mels": "num_mel_bins",
        "enc_dim": "d_model",
        "enc_layers": "encoder_layers",
        "enc_heads": "encoder_attention_heads",
        "enc_ffn_hidden": "encoder_ffn_dim",
        "enc_positions": "max_source_positions",
    },
    "parakeet": {
        "n_mels": "num_mel_bins",
        "enc_dim": "hidden_size",
        "enc_layers": "num_hidden_layers",
        "enc_heads": "num_attention_heads",
        "enc_ffn_hidden": "intermediate_size",
        "enc_subsampling": "subsampling_factor",
        "enc_conv_channels": "subsampling_conv_channels",
        "enc_conv_kernel": "conv_kernel_size",
    },
}


def encoder_config(path: Path, key: str = KEY) -> tuple[str, dict[str, Any]]:
    """The family of the encoder in ``path`` and its own config (a ParakeetForCTC's
    ``encoder_config``; a Whisper config holds the encoder's and the decoder's fields)."""
    config = read_config(path)
    model_type = model_family(config, FAMILIES, f"{key}={path}")
    if model_type == "parakeet_ctc":
        config = config["encoder_config"]
    return FAMILIES[model_type], config


def encoder_fields(directory: str | Path, key: str = KEY) -> dict[str, Any]:
    """The SALMConfig fields of the encoder in ``directory`` (the LLM's stay as they are)."""
    path = check_directory(directory, key)
    family, config = encoder_config(path, key)
    fields = {"encoder": family, "encoder_dir": str(path)}
    fields.update({field: int(config[name]) for field, name in SHAPE_KEYS[family].items()})
    if family == "whisper":
        return {**fields, "enc_subsampling": 2}  # conv1 keeps the frame rate, conv2 halves it
    kernel, stride = (
        config.get("subsampling_conv_kernel_size"),
        config.get("subsampling_conv_stride"),
    )
    if (kernel, stride) != (3, 2):
        raise ValueError(
            f"{key}={directory}: subsampling convolutions of kernel {kernel} and stride {stride} "
            "are not supported (only kernel 3, stride 2)"
        )
    return {
        **fields,
        "enc_bias": bool(config.get("attention_bias", True)),
        "enc_conv_bias": bool(config.get("convolution_bias", True)),
    }
