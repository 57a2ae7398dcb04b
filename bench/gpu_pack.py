"""What the GPU check needs that a GPU machine with no network lacks, packed into ``.gpu/``.

    python -m bench.gpu_pack            # here, with network: writes .gpu/ (ignored by git)
    bash bench/gpu_check.sh             # there: installs .gpu/wheels, reads .gpu/whisper-tiny.en

A lent GPU machine has torch, transformers' dependencies and most of the scientific stack, but
not this toolkit's data and config libraries, and it takes at most 64 MiB of files per call.
``.gpu/wheels`` holds the missing packages at this environment's versions (x86-64, CPython 3.12
wheels), ``.gpu/whisper-tiny.en`` the encoder of ``make pretrained``'s Whisper tiny.en alone, in
fp16 (16 MB instead of the whole model's 151 MB in fp32): bench/gpu_check.py widens it back to
fp32 there. SmolLM2 (538 MB) stays behind.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACK = REPO / ".gpu"
WHISPER = "whisper-tiny.en"
# Not on the GPU image (device README's package list), at the versions this environment runs.
WHEELS = (
    "hydra-core",
    "omegaconf",
    "lhotse",
    "audioread",
    "cytoolz",
    "intervaltree",
    "soundfile",
    "cffi",
    "pycparser",
    "braceexpand",
    "jiwer",
    "rapidfuzz",
    "whisper-normalizer",
    "indic-numtowords",
    "text2num",
    "more-itertools",
    "transformers",  # the image's is older than pyproject.toml's floor
    "peft",
    # bench/bench_torchtitan.py: torchtitan and what its llama3 imports (Makefile's pin)
    "torchtitan",
    "spmd_types",
    "tyro",
    "typeguard",
    "docstring_parser",
)
# Published as a source archive only (pure Python): built into a wheel here.
BUILT = ("antlr4-python3-runtime",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CONFIGS = ("config.json", "preprocessor_config.json")


def download_wheels(out: Path, extra: tuple[str, ...] = ()) -> None:
    """``WHEELS`` and ``extra`` at this environment's versions, for the GPU image's Python."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", "-d", str(out), "-q"]
    command += [f"--platform={platform}" for platform in PLATFORMS]
    command += [f"{name}=={version(name)}" for name in (*WHEELS, *extra)]
    subprocess.run(command, check=True)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out)]
    subprocess.run([*build, *(f"{name}=={version(name)}" for name in BUILT)], check=True)


def pack_whisper(source: Path, out: Path) -> None:
    """The encoder's tensors alone (names without the ``model.encoder.`` prefix, as an export
    writes an encoder) in fp16, beside the model's configs."""
    import torch
    from safetensors.torch import load_file, save_file

    prefix = "model.encoder."
    state = load_file(source / "model.safetensors")
    encoder = {
        name.removeprefix(prefix): tensor.to(torch.float16).contiguous()
        for name, tensor in state.items()
        if name.startswith(prefix)
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(encoder, out / "model.safetensors", metadata={"format": "pt"})
    for name in CONFIGS:
        shutil.copy2(source / name, out / name)
    (out / "packed.json").write_text(json.dumps({"from": str(source), "dtype": "float16"}))


def unpack_whisper(packed: Path, out: Path) -> Path:
    """``packed`` widened back to fp32 in ``out`` (what the trainer loads)."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    state = load_file(packed / "model.safetensors")
    save_file({k: v.to(torch.float32) for k, v in state.items()}, out / "model.safetensors")
    for name in CONFIGS:
        shutil.copy2(packed / name, out / name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrained", type=Path, default=REPO / "data" / "pretrained")
    parser.add_argument("--out", type=Path, default=PACK)
    args = parser.parse_args()
    source = args.pretrained / WHISPER
    if not (source / "model.safetensors").is_file():
        print(f"error: {source} is missing: run `make pretrained` first", file=sys.stderr)
        return 2
    download_wheels(args.out / "wheels")
    pack_whisper(source, args.out / WHISPER)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"gpu_pack: {args.out} holds {size / 2**20:.1f} MiB (a device call takes 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
