"""An exported speech LLM (what ``python -m train.export`` writes) read back, sharded.

The layout, owned here::

    OUT/llm/                  the LLM, a transformers model directory (tokenizer included)
    OUT/lora/                 with --adapters: peft's adapter_config.json, adapter_model.safetensors
    OUT/encoder/              a pretrained encoder's run: the encoder as a transformers directory
                              (config.json, model.safetensors, preprocessor_config.json)
    OUT/speech.safetensors    the projector, and the own audio encoder, under the project's names
    OUT/speech_config.json    the model config, step, corpus, audio token, and which dirs exist

``python -m train.evaluate run_dir=OUT`` decodes with it at any layout: the model is built on
the meta device and parallelized as for training, then each rank reads its shards of every file
with DCP's Hugging Face reader (no rank ever holds a full copy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from train.config import ConfigError, ModelConfig, model_from_record
from train.models.hf_config import CONFIG_FILE, WEIGHT_FILES
from train.models.hf_names import hf_name
from train.models.hf_weights import load_encoder_weights, load_llm_weights
from train.models.init import canonical_name
from train.models.lora import adapter_module, is_adapter
from train.models.pretrained_parts import ENCODER_PREFIX

LLM_DIR, LORA_DIR, ENCODER_DIR = "llm", "lora", "encoder"
SPEECH_WEIGHTS, SPEECH_CONFIG = "speech.safetensors", "speech_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what peft puts before a model's own names


def peft_name(module: str, part: str) -> str:
    """peft's saved name of the ``part`` (lora_A or lora_B) matrix of our projection ``module``:
    ``llm.layers.3.attn.wq`` and lora_A give
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``."""
    return f"{PEFT_PREFIX}{hf_name(f'{module}.weight').removesuffix('.weight')}.{part}.weight"


def is_export(directory: Path) -> bool:
    return (directory / SPEECH_CONFIG).is_file()


@dataclass(frozen=True)
class Export:
    """What an export's speech_config.json records."""

    directory: Path
    model: ModelConfig  # pretrained_llm: OUT/llm, absolute (None for a preset's byte-level LLM)
    step: int
    corpus: str | None  # the corpus the run trained on, when it recorded one
    lora: bool  # adapters in OUT/lora (False: none, or merged into OUT/llm)


def read_export(directory: Path) -> Export:
    """The export in ``directory``; a missing part is one ConfigError line."""
    record = json.loads((directory / SPEECH_CONFIG).read_text())
    model = dict(record["model"])
    # A pretrained LLM's export carries its tokenizer (with the audio token); a preset's LLM
    # reads bytes, and its shape is the preset's (written as a Llama of the same blocks).
    pretrained = record.get("audio_token") is not None
    model["pretrained_llm"] = str((directory / LLM_DIR).resolve()) if pretrained else None
    # A pretrained encoder's export carries it as a transformers directory of its own.
    encoder = directory / ENCODER_DIR if record.get("encoder_dir") else None
    model["pretrained_encoder"] = None if encoder is None else str(encoder.resolve())
    lora = bool(record.get("lora_dir"))
    needed = [directory / LLM_DIR, directory / SPEECH_WEIGHTS]
    needed += [directory / LORA_DIR / ADAPTER_WEIGHTS] if lora else []
    needed += [] if encoder is None else [encoder / CONFIG_FILE, encoder / WEIGHT_FILES[0]]
    for path in needed:
        if not path.exists():
            raise ConfigError(f"{directory} is an incomplete export: {path.name} is missing")
    step, corpus = int(record["step"]), record.get("corpus")
    return Export(directory, model_from_record(model), step, corpus, lora)


@torch.no_grad()
def load_export(model: nn.Module, export: Export) -> None:
    """Fill ``model`` (whole, a pipeline stage, sharded or not) from the export's files, each
    rank reading the slices its shards hold."""
    load_llm_weights(model, export.directory / LLM_DIR)
    encoder = export.model.pretrained_encoder
    if encoder is not None:
        load_encoder_weights(model, Path(encoder))
    names = {canonical_name(name): param for name, param in model.named_parameters()}
    elsewhere = ("llm.",) if encoder is None else ("llm.", ENCODER_PREFIX)
    speech = {name: param for name, param in names.items() if not name.startswith(elsewhere)}
    if speech:
        reader = dcp.HuggingFaceStorageReader(str(export.directory))
        dcp.load(speech, storage_reader=reader)
    adapters = {peft_name(*adapter_module(n)): p for n, p in names.items() if is_adapter(n)}
    if adapters:
        reader = dcp.HuggingFaceStorageReader(str(export.directory / LORA_DIR))
        dcp.load(adapters, storage_reader=reader)
