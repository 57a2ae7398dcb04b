"""``python -m train.export RUN_DIR --out DIR [--step N | --checkpoint PATH] [--dtype D]``: a
trained run as Hugging Face files.

- ``DIR/llm``: the LLM as a ``transformers`` model directory (``config.json``,
  ``model.safetensors``, the tokenizer with ``<|audio|>``, ``generation_config.json``) that
  ``AutoModelForCausalLM`` and ``AutoTokenizer`` load offline. A run from
  ``model.pretrained_llm`` keeps its family's config (Llama, Qwen2, Qwen3); a preset's decoder is
  written as a Llama (same blocks), with no tokenizer (its text is UTF-8 bytes, ids 0-255, then
  pad, bos, eos).
- With LoRA adapters (``model.lora``): merged into their projections (``W + alpha/rank B A``,
  in fp32), or with ``--adapters`` written apart as ``DIR/lora`` (``adapter_config.json`` and
  ``adapter_model.safetensors`` in peft's names), ``DIR/llm`` then holding the unmerged LLM, so
  ``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR/llm), DIR/lora)``.
- ``DIR/encoder`` (a run from ``model.pretrained_encoder``): the trained encoder as a
  ``transformers`` directory of the encoder alone (``config.json``, ``model.safetensors`` in its
  own names, the feature extractor's ``preprocessor_config.json`` copied), which
  ``WhisperEncoder`` or ``ParakeetEncoder.from_pretrained`` loads offline.
- ``DIR/speech.safetensors`` and ``DIR/speech_config.json``: the projector (and the own audio
  encoder) under the project's names, and what joins them to the LLM: the model config (shape,
  prompt, system), the audio token, the step, the corpus. ``python -m train.evaluate run_dir=DIR``
  decodes with the export (``train.exported`` owns this layout and reads it back).

One process on the CPU: the model is built once in fp32 (the log says how much memory that
takes before it allocates) and filled from the DCP checkpoint, whatever layout saved it. The
files are written into a temporary directory beside ``DIR`` and renamed: ``DIR`` exists whole
or not at all, and an existing ``DIR`` is refused, never overwritten.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from contract.job_end import EXIT_CONFIG
from train.checkpoint.location import Ref
from train.checkpoint.manager import CheckpointError, CheckpointManager
from train.checkpoint.saved_run import find_checkpoint, saved_model, saved_state
from train.config import ConfigError, LoraConfig, ModelConfig
from train.data.features import PREPROCESSOR_FILE
from train.data.prompt import AUDIO_TOKEN, load_tokenizer
from train.data.text import ByteTokenizer
from train.exported import (
    ADAPTER_WEIGHTS,
    ENCODER_DIR,
    LLM_DIR,
    LORA_DIR,
    SPEECH_CONFIG,
    SPEECH_WEIGHTS,
    peft_name,
)
from train.models.hf_config import CONFIG_FILE, WEIGHT_FILES, read_config
from train.models.hf_encoder import transformers_class
from train.models.hf_encoder_config import encoder_config
from train.models.hf_names import PROJECTIONS, hf_name
from train.models.hf_weights import encoder_state, llm_state
from train.models.inventory import inventory
from train.models.lora import LORA_A, LORA_B, adapter_names, merged_weight
from train.models.pretrained_parts import ENCODER_PREFIX
from train.models.salm import SALM
from train.models.shape import SALMConfig, llm_head_dim
from train.parallel.layout import model_of

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# What a preset's decoder is in transformers' terms: Llama's blocks are ours (RMSNorm before
# attention and the SwiGLU FFN, rotate-half RoPE, GQA, no biases).
MAX_POSITIONS = 8192


def say(line: str) -> None:
    print(f"[export] {line}", file=sys.stderr, flush=True)


def preset_llm_config(shape: SALMConfig) -> dict:
    """A Llama config.json for a preset's decoder (dense presets only)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.d_model,
        "intermediate_size": shape.ffn_hidden,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": llm_head_dim(shape),
        "hidden_act": "silu",
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": MAX_POSITIONS,
        "pad_token_id": ByteTokenizer.pad_id,
        "bos_token_id": ByteTokenizer.bos_id,
        "eos_token_id": ByteTokenizer.eos_id,
    }


def source_dtype(config: dict) -> torch.dtype:
    """The dtype the pretrained files were in (bf16 when the config does not say)."""
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return {value: key for key, value in DTYPE_NAMES.items()}.get(name, torch.bfloat16)


def with_rows(state: dict[str, torch.Tensor], rows: int, tied: bool) -> dict[str, torch.Tensor]:
    """The embedding (and an untied head) grown to ``rows`` rows, each new row the mean of the
    trained ones: a token the LLM never saw starts where its neighbours are on average."""
    names = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    for name in names:
        weight = state[name]
        extra = weight.mean(dim=0, keepdim=True).expand(rows - weight.shape[0], -1)
        state[name] = torch.cat([weight, extra])
    return state


def check_out(out: Path) -> None:
    if out.exists():
        raise ConfigError(f"--out {out} already exists; give a new directory (nothing written)")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: its parent {out.parent} does not exist")


def plan_export(args: argparse.Namespace) -> tuple[Ref, dict, ModelConfig, SALMConfig]:
    """Everything checkable before the model is built; one ConfigError line otherwise."""
    out = Path(args.out)
    check_out(out)
    checkpoint = find_checkpoint(Path(args.run_dir), args.checkpoint, args.step)
    state = saved_state(checkpoint)
    model_cfg = saved_model(checkpoint, state)
    shape = model_of(model_cfg)
    if shape.n_experts:
        raise ConfigError(
            f"{checkpoint}: an MoE LLM ({shape.n_experts} experts) has no Hugging Face family "
            "here to export to; export dense models (Llama, Qwen2, Qwen3 or a dense preset)"
        )
    if args.adapters and not shape.lora_rank:
        raise ConfigError(
            f"--adapters: {checkpoint} was trained without LoRA adapters (model.lora.rank=0); "
            "export without --adapters"
        )
    return checkpoint, state, model_cfg, shape


def llm_weights(model: SALM, shape: SALMConfig, merge: bool) -> dict[str, torch.Tensor]:
    """The LLM's tensors in Hugging Face names, its LoRA adapters merged when ``merge``."""
    state = {name: param.detach() for name, param in llm_state(model).items()}
    if merge:
        params = dict(model.named_parameters())
        for prefix in adapted_modules(shape):
            a, b = adapter_names(prefix)
            name = hf_name(f"{prefix}.weight")
            state[name] = merged_weight(state[name], params[a], params[b], shape)
    return state


def adapted_modules(shape: SALMConfig) -> list[str]:
    """Every projection that carries an adapter, as a plain model names it."""
    return [
        f"llm.layers.{index}.{module}"
        for index in range(shape.n_layers)
        for module in shape.lora_targets
    ]


def write_adapters(folder: Path, model: SALM, shape: SALMConfig, dtype: torch.dtype) -> None:
    """DIR/lora: the adapters as peft saves them (its config and its tensor names)."""
    import peft

    params = dict(model.named_parameters())
    tensors = {}
    for prefix in adapted_modules(shape):
        for part, name in zip((LORA_A, LORA_B), adapter_names(prefix), strict=True):
            tensors[peft_name(prefix, part)] = params[name].detach().to(dtype).contiguous()
    targets = sorted(name for name, module in PROJECTIONS.items() if module in shape.lora_targets)
    config = peft.LoraConfig(
        r=shape.lora_rank,
        lora_alpha=shape.lora_alpha,
        lora_dropout=shape.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        base_model_name_or_path=LLM_DIR,
    )
    config.save_pretrained(folder)
    save_file(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})


def write_llm(
    folder: Path,
    model: SALM,
    source: Path | None,
    shape: SALMConfig,
    dtype: torch.dtype,
    merge: bool,
) -> dict:
    """DIR/llm: weights in Hugging Face names, config, tokenizer and generation config."""
    folder.mkdir()
    state = {name: t.to(dtype) for name, t in llm_weights(model, shape, merge).items()}
    if shape.tie_embeddings:
        state.pop("lm_head.weight", None)
    if source is not None:
        config = read_config(source)
        tokenizer = load_tokenizer(source)
        rows = len(tokenizer)
        if rows > shape.vocab_size:  # the audio token needs a row of its own
            state = with_rows(state, rows, shape.tie_embeddings)
            config["vocab_size"] = rows
        tokenizer.save_pretrained(folder)
        if (source / "generation_config.json").is_file():
            shutil.copy(source / "generation_config.json", folder)
    else:
        config = preset_llm_config(shape)
    config.pop("torch_dtype", None)
    config["dtype"] = DTYPE_NAMES[dtype]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: tensor.contiguous() for name, tensor in state.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return config


def write_encoder(folder: Path, model: SALM, source: Path, dtype: torch.dtype) -> None:
    """DIR/encoder: the pretrained encoder's config (of the encoder alone, as ``source`` has
    it), its weights under transformers' names, and its feature extractor's config."""
    folder.mkdir()
    family, config = encoder_config(source)
    config = {**config, "architectures": [transformers_class(family).__name__]}
    config.pop("torch_dtype", None)
    config["dtype"] = DTYPE_NAMES[dtype]
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in encoder_state(model).items()}
    for name in [name for name in tensors if name.endswith(".running_mean")]:
        # transformers' BatchNorm1d also keeps a counter that frozen statistics never advance.
        counter = name.removesuffix("running_mean") + "num_batches_tracked"
        tensors[counter] = torch.zeros((), dtype=torch.long, device="cpu")
    save_file(tensors, folder / WEIGHT_FILES[0], metadata={"format": "pt"})
    shutil.copy(source / PREPROCESSOR_FILE, folder)


def write_speech(
    out: Path, model: SALM, model_cfg: ModelConfig, shape: SALMConfig, state: dict, merged: bool
):
    """The projector (and the own encoder), and the config that joins them to DIR/llm (and
    DIR/lora, DIR/encoder)."""
    pretrained = model_cfg.pretrained_encoder is not None
    elsewhere = ("llm.", ENCODER_PREFIX) if pretrained else ("llm.",)
    parts = {
        name: param.detach().contiguous()
        for name, param in model.named_parameters()
        if not name.startswith(elsewhere)
    }
    save_file(parts, out / SPEECH_WEIGHTS, metadata={"format": "pt"})
    encoder_dir = ENCODER_DIR if pretrained else None
    shape = dataclasses.replace(shape, encoder_dir=encoder_dir)
    model_record = {
        **dataclasses.asdict(model_cfg),
        "pretrained_llm": LLM_DIR,
        "pretrained_encoder": encoder_dir,
    }
    if merged:  # the exported LLM carries its adapters in its weights
        model_record["lora"] = dataclasses.asdict(LoraConfig())
        shape = dataclasses.replace(shape, lora_rank=0, lora_targets=())
    record = {
        "step": int(state["step"]),
        "corpus": state.get("trainer_state", {}).get("corpus"),
        "model": model_record,
        "shape": dataclasses.asdict(shape),
        "audio_token": AUDIO_TOKEN if model_cfg.pretrained_llm else None,
        "llm_dir": LLM_DIR,
        "lora_dir": LORA_DIR if shape.lora_rank else None,  # merged: the shape has none
        "encoder_dir": encoder_dir,
    }
    (out / SPEECH_CONFIG).write_text(json.dumps(record, indent=2) + "\n")


def readable(folder: Path) -> None:
    """The modes a plain ``mkdir`` and ``open`` would have given (the temporary directory and
    safetensors' files are private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def load_trained(run_dir: Path, checkpoint: Ref, shape: SALMConfig) -> SALM:
    """The whole model of ``checkpoint`` in one process, fp32 on the CPU."""
    with torch.device("meta"):
        model = SALM(shape)
    model.to_empty(device="cpu")
    model.llm.tie_head()
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": so it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            CheckpointManager(run_dir).load(checkpoint, model, None, None)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    return model.eval()


def export(args: argparse.Namespace) -> Path:
    checkpoint, state, model_cfg, shape = plan_export(args)
    out = Path(args.out)
    dtype = DTYPES[args.dtype] if args.dtype else None
    # Where the run's pretrained parts came from (absolute, as the checkpoint records them).
    llm = Path(model_cfg.pretrained_llm) if model_cfg.pretrained_llm else None
    encoder = Path(model_cfg.pretrained_encoder) if model_cfg.pretrained_encoder else None
    if dtype is None:
        dtype = source_dtype(read_config(llm)) if llm is not None else torch.float32
    fp32 = sum(t.numel for t in inventory(shape)) * 4
    size = f"{fp32 / 2**30:.1f} GiB" if fp32 >= 2**30 else f"{fp32 / 2**20:.1f} MiB"
    step = state["step"]
    say(f"{checkpoint} (step {step}): the model in fp32 on the CPU takes {size} of memory")
    started = time.perf_counter()
    model = load_trained(Path(args.run_dir), checkpoint, shape)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        merge = bool(shape.lora_rank) and not args.adapters
        write_llm(staging / LLM_DIR, model, llm, shape, dtype, merge)
        if encoder is not None:  # in --dtype, else the encoder files' own
            own = source_dtype(read_config(encoder))
            write_encoder(staging / ENCODER_DIR, model, encoder, DTYPES.get(args.dtype) or own)
        if shape.lora_rank and args.adapters:
            write_adapters(staging / LORA_DIR, model, shape, dtype)
        write_speech(staging, model, model_cfg, shape, state, merge)
        readable(staging)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    extras = f", {LORA_DIR}/" if shape.lora_rank and args.adapters else ""
    extras += " (LoRA merged)" if shape.lora_rank and not args.adapters else ""
    extras += f", {ENCODER_DIR}/" if encoder is not None else ""
    written = f"{LLM_DIR}/ ({DTYPE_NAMES[dtype]}){extras}, {SPEECH_WEIGHTS}, {SPEECH_CONFIG}"
    say(f"wrote {out} in {time.perf_counter() - started:.1f} s: {written}")
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m train.export",
        description="Write a trained run's LLM as a Hugging Face model directory (OUT/llm) and "
        "its audio encoder and projector beside it.",
    )
    parser.add_argument("run_dir", help="the training run (its checkpoints/)")
    parser.add_argument("--out", required=True, help="a new directory to write")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the checkpoint of this step (default: newest)")
    which.add_argument("--checkpoint", help="a step_<N> directory")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), help="weights' dtype (default: the pretrained files')"
    )
    parser.add_argument(
        "--adapters",
        action="store_true",
        help=f"write LoRA adapters apart as OUT/{LORA_DIR} (peft's files) instead of merging them",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        export(args)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
