"""A pretrained Hugging Face decoder's shape, read from its ``config.json`` with plain json (no
torch, no transformers), so that the trainer, its preflight and the planner agree on it.

The trainer never downloads: ``model.pretrained_llm`` names a local directory made by
``save_pretrained`` or fetched beforehand (``hf download NAME --local-dir DIR``).
Families whose decoder maps onto the project's own blocks (``train/models/salm.py``): Llama
(RMSNorm, RoPE, SwiGLU, GQA), Qwen2 (the same with q/k/v biases) and Qwen3 (with an RMSNorm over
each head of q and k). Options the blocks do not have are refused with one line, never ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
# Either the one file or the index of its shards.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
FETCH_HINT = (
    "the trainer never downloads: fetch the model beforehand "
    "(hf download NAME --local-dir DIR; the example models of data/pretrained: make pretrained) "
    "and give DIR"
)
# config.json's model_type -> whether its q/k/v projections always carry biases (Qwen2), and
# whether each head of q and k is RMS-normalized before RoPE (Qwen3).
FAMILIES: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
}


def check_directory(directory: str | Path, key: str) -> Path:
    """The model directory, with its config and weights; a hub id or a missing file is one
    line naming what is missing and how to fetch it."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        kind = "looks like a hub id, not a directory" if "/" in str(directory) else "no such dir"
        raise ValueError(f"{key}={directory}: {kind}; {FETCH_HINT}")
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{key}={directory}: no {CONFIG_FILE} in it; {FETCH_HINT}")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(
            f"{key}={directory}: no safetensors weights ({' or '.join(WEIGHT_FILES)}); "
            f"{FETCH_HINT} (PyTorch .bin weights: convert them with save_pretrained first)"
        )
    return path.resolve()


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / CONFIG_FILE).read_text())


def model_family(config: dict[str, Any], families: Mapping[str, Any], where: str) -> str:
    """``config``'s model_type, one of ``families``; another is one line naming it."""
    family = config.get("model_type")
    if family not in families:
        architecture = ",".join(config.get("architectures") or ["?"])
        raise ValueError(
            f"{where}: {architecture} (model_type {family!r}) is not supported; supported: "
            f"{', '.join(families)}"
        )
    return family


def _rope_theta(config: dict[str, Any], key: str) -> float:
    """RoPE's base from either spelling (``rope_theta``, or transformers 5's
    ``rope_parameters``); scaled RoPE variants are refused."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if kind not in (None, "default"):
        raise ValueError(f"{key}: rope type {kind!r} is not supported yet (only plain RoPE)")
    theta = config.get("rope_theta", parameters.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{key}: {CONFIG_FILE} names no rope_theta")
    return float(theta)


def decoder_fields(directory: str | Path, key: str = "model.pretrained_llm") -> dict[str, Any]:
    """The SALMConfig fields of the LLM in ``directory`` (the encoder's fields stay the
    preset's)."""
    path = check_directory(directory, key)
    config = read_config(path)
    where = f"{key}={directory}"
    family = model_family(config, FAMILIES, where)
    refused = {
        "attention_bias": family != "qwen2" and config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
        "use_sliding_window": config.get("use_sliding_window", False),
        "hidden_act": config.get("hidden_act", "silu") != "silu",
    }
    for name, present in refused.items():
        if present:
            raise ValueError(f"{where}: {name}={config.get(name)!r} is not supported")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {
        "d_model": hidden,
        "n_layers": int(config["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(config.get("num_key_value_heads") or heads),
        "ffn_hidden": int(config["intermediate_size"]),
        "vocab_size": int(config["vocab_size"]),
        "rope_theta": _rope_theta(config, where),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "head_dim": 0 if head_dim * heads == hidden else head_dim,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "n_experts": 0,
        **FAMILIES[family],
    }
