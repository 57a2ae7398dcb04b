"""The GPU check: what users run, on one GPU with no network, in about 5 minutes.

    python -m bench.gpu_pack          # here, once: .gpu/ (wheels, Whisper tiny.en's encoder)
    bash bench/gpu_check.sh           # there: flows, then speed (carry .gpu)
    bash bench/gpu_check.sh flows     # or one part: flows | speed | extra
    bash bench/gpu_check.sh --cpu     # every part reduced, on the CPU (what CI runs)

``flows`` (bench/gpu_flows.py) runs the toolkit's entrypoints as a user does: a compiled bf16
``python -m train`` with validation and asynchronous checkpoints, as one job and as a chain of
two whose second resumes bitwise; the same eager in fp32; the real Whisper tiny.en encoder with
the preset decoder's LoRA adapters compiled by inductor; speech, conversations and text mixed,
compiled; ``train.evaluate`` with the KV cache on the GPU against the CPU; ``train.export``
reloaded by ``transformers``. Every training step after the second runs under CUDA's sync debug
mode (``--host-syncs``, default error: a host sync fails the check; warn lists each site
instead).

``speed`` measures: ``bench/bench_fast_path.py`` for ``llm_1b`` at each activation
checkpointing mode, eager and compiled, on an audio-heavy and a text-heavy batch (tokens/s, MFU
against the datasheet peak and against the bf16 matmul ceiling measured on this GPU, peak
memory), the experts' aligned grouped GEMM against per-expert matmuls, and
``bench/bench_torchtitan.py``: our decoder and torchtitan's Llama at the same shape, each with
its own parallelize path, side by side. ``extra`` (not in the default run): the kernel bench
(``bench/bench_kernels.py``, the planner's calibration) and the async checkpoint stall.

Each part prints one markdown table and writes ``OUT/gpu_check_<part>.json``; the fast path's
measured steps also go to ``OUT/measurements.csv``, in the columns of the planner's table of
published measurements (``orchestrator/planner/measured.py``): a row from an H100 joins that
table as it is, and ``orchestrator plan --measured OUT/measurements.csv`` prices each row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.bench_fast_path import run_spec
from bench.gpu_flows import part_flows
from bench.gpu_pack import PACK, WHISPER, unpack_whisper
from contract.gpus import gpu_of_device
from orchestrator.planner.measured import PRICED, append
from train.loop.host_syncs import HOST_SYNC_MODES
from train.parallel.dims import AC_MODES

REPO = Path(__file__).resolve().parents[1]

# Fast-path batches: (utterances, audio seconds, transcript tokens) per step.
BATCHES = {"audio": (8, 20.0, 128), "text": (4, 0.5, 2048)}
STALL = re.compile(r"stall / synchronous save: ([0-9.]+)%")
PARTS = ("flows", "speed", "extra")


def settings(cpu: bool) -> dict:
    """Sizes for a GPU or for the reduced CPU form."""
    if cpu:
        return {
            "device": "cpu",
            "preset": "tiny",
            "fast_preset": "tiny",
            "fast_path": [(False, "none", "audio")],
            "batches": {"audio": (2, 2.0, 16)},
            "bench_steps": ["--steps", "2", "--warmup", "1"],
            "corpus": 64,
            "nproc": 2,  # FSDP2 over 2 gloo ranks
            # First training batches of a single utterance, validation batches of one and two:
            # the compiled shapes' budget (4 graphs per region) is checked on real batches.
            "train": ["data.max_duration=5", "eval.max_duration=3.5", "data.num_workers=0"],
            "steps": 6,
            # Dynamo and AOT autograd decide the graphs and recompiles whatever generates the
            # code. Inductor's CPU code (g++ per kernel: half of this form's CPU time) is not what
            # a GPU runs; its lowering of the blocks is held to eager at FSDP2 and two pipeline
            # stages by tests/test_trainer_equivalence.py.
            "compile_backend": "aot_eager",
            "host_syncs": "off",
            "checkpoint_models": ["small"],
        }
    return {
        "device": "cuda",
        "preset": "small",
        "fast_preset": "llm_1b",
        "fast_path": [
            (compile_, ac, batch)
            for batch in BATCHES
            for compile_ in (False, True)
            for ac in AC_MODES
        ],
        "batches": BATCHES,
        "bench_steps": ["--steps", "6", "--warmup", "3"],
        "corpus": 400,
        "nproc": 1,
        "train": ["data.max_duration=60", "eval.max_duration=60", "data.num_workers=2"],
        "steps": 12,
        "compile_backend": "inductor",
        "host_syncs": "error",
        "checkpoint_models": ["small", "wide"],
    }


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... failed:\n{done.stderr[-3000:]}")
    return done


def fast_path(s: dict) -> list[dict]:
    """Every fast-path configuration in one process (each model built afresh)."""
    specs = [run_spec(c, ac, s["batches"][batch]) for c, ac, batch in s["fast_path"]]
    command = [sys.executable, "-m", "bench.bench_fast_path", "--runs", ",".join(specs)]
    command += ["--preset", s["fast_preset"], "--device", s["device"], *s["bench_steps"]]
    command += ["--host-syncs", s["host_syncs"]]
    lines = run(command).stdout.strip().splitlines()
    rows = []
    for (_, _, batch), line in zip(s["fast_path"], lines[-len(specs) :], strict=True):
        rows.append({**json.loads(line), "batch": batch})
        print(f"gpu_check: fast path {json.dumps(rows[-1])}", flush=True)
    return rows


def fast_path_run(text: str, s: dict) -> tuple[bool, str, str]:
    """``compiled:selective:audio`` as (compile, ac, batch)."""
    parts = text.split(":")
    if (
        len(parts) != 3
        or parts[0] not in ("eager", "compiled")
        or parts[1] not in AC_MODES
        or parts[2] not in s["batches"]
    ):
        raise ValueError(
            f"{text!r} is not eager|compiled:{'|'.join(AC_MODES)}:{'|'.join(s['batches'])}"
        )
    return parts[0] == "compiled", parts[1], parts[2]


def kernels(s: dict, out: Path) -> dict:
    """bench/bench_kernels.py's figures (reduced on the CPU)."""
    command = [sys.executable, "-m", "bench.bench_kernels", "--device", s["device"]]
    command += ["--out", str(out / "kernels.json")]
    run([*command, *(["--quick"] if s["device"] == "cpu" else [])])
    return json.loads((out / "kernels.json").read_text())


def grouped_gemm_error(device: str) -> float:
    """Largest relative error of the aligned grouped GEMM against per-expert matmuls in fp32,
    on uneven groups (an empty one, one of a single row), in bf16 on CUDA."""
    import torch
    import torch.nn.functional as F

    from train.models.moe import swiglu_experts

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([37, 0, 1, 250, 16, 9, 64, 3])
    x = torch.randn(int(counts.sum()), 256, generator=g)
    w1, w3 = (torch.randn(8, 256, 512, generator=g) / 16 for _ in range(2))
    w2 = torch.randn(8, 512, 256, generator=g) / 22
    weights = (t.to(device, dtype) for t in (w1, w3, w2))
    got = swiglu_experts(x.to(device, dtype), counts.to(device), *weights)
    want, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        rows = x[start : start + count]
        start += count
        want.append((F.silu(rows @ w1[expert]) * (rows @ w3[expert])) @ w2[expert])
    reference = torch.cat(want)
    return float((got.float().cpu() - reference).abs().max() / reference.abs().max())


def checkpoint_stall(s: dict) -> dict[str, float]:
    command = [sys.executable, "-m", "bench.bench_async_checkpoint", "--saves", "3"]
    out = run([*command, "--models", *s["checkpoint_models"]]).stdout
    return dict(
        zip(s["checkpoint_models"], (float(v) / 100 for v in STALL.findall(out)), strict=True)
    )


def torchtitan(s: dict, out: Path) -> dict:
    """bench/bench_torchtitan.py's rows: ours and torchtitan's at the same shapes."""
    command = [sys.executable, "-m", "bench.bench_torchtitan", "--out"]
    command += [str(out / "torchtitan.json"), *(["--cpu"] if s["device"] == "cpu" else [])]
    run(command, timeout=900)
    return json.loads((out / "torchtitan.json").read_text())


def part_speed(s: dict, out: Path) -> dict:
    return {
        "fast_path": fast_path(s),
        "grouped_gemm_rel_error": grouped_gemm_error(s["device"]),
        "torchtitan": torchtitan(s, out),
    }


def part_extra(s: dict, out: Path) -> dict:
    return {"kernels": kernels(s, out), "checkpoint_stall": checkpoint_stall(s)}


def whisper_dir(given: Path | None, out: Path) -> Path:
    """The Whisper tiny.en directory the flows train with: ``given``, else ``.gpu``'s packed
    encoder (widened to fp32 into ``out``), else ``make pretrained``'s."""
    packed = given or PACK / WHISPER
    if (packed / "packed.json").is_file():
        return unpack_whisper(packed, out / WHISPER)
    if given is not None:
        return given
    return REPO / "data" / "pretrained" / WHISPER


def fast_path_lines(result: dict) -> list[str]:
    lines = []
    for r in result["fast_path"]:
        what = f"fast path ({r['batch']}), compile={r['compile']}, ac={r['ac']}"
        if "error" in r:
            lines.append(f"| {what} | failed: {r['error']} |")
            continue
        figure = f"{r['tokens_per_s']:.0f} tokens/s, {r['step_time_s']:.3f} s/step"
        if "mfu_datasheet" in r:
            figure += (
                f", MFU {r['mfu_datasheet'] or 0:.1%} (datasheet) /"
                f" {r['mfu_measured_ceiling']:.1%} (measured matmul ceiling"
                f" {r['matmul_ceiling_tflops']:.0f} TFLOP/s), {r['peak_memory_gib']:.1f} GiB"
            )
        lines.append(f"| {what} | {figure} |")
    return lines


def torchtitan_lines(result: dict) -> list[str]:
    """Per shape: both tokens/s and peak allocated memory, and ours / torchtitan."""
    lines = []
    for r in result["ratios"]:
        ours, theirs = (
            next(row for row in result["rows"] if (row["shape"], row["impl"]) == (r["shape"], impl))
            for impl in ("ours", "torchtitan")
        )
        figure = f"{ours['tokens_per_s']:.0f} / {theirs['tokens_per_s']:.0f} tokens/s "
        figure += f"(x{r['tokens_per_s']:.2f})"
        if r["peak_allocated_gib"] is not None:
            figure += f", peak allocated x{r['peak_allocated_gib']:.2f}"
        lines.append(f"| {r['shape']}: ours / torchtitan | {figure} |")
    return lines


def table(part: str, result: dict) -> str:
    lines = ["| what | figure |", "| --- | --- |"]
    if part == "flows":
        lora, mix = result["whisper_lora"], result["mixture"]
        lines += [
            f"| chain of 2 jobs vs one, {result['resumed_steps']} resumed steps, bitwise | "
            f"{', '.join(f'{k} {v}' for k, v in result['bitwise'].items())} |",
            f"| compiled bf16 vs eager fp32, max rel. diff | {result['loss_rel_diff_vs_fp32']:.2e}"
            f" (validation {result['val_loss_rel_diff_vs_fp32']:.2e}) |",
            f"| recompiles (graphs per region) | {result['recompiles']} ({result['graphs']}) |",
            f"| host syncs named by CUDA | {', '.join(result['host_syncs']) or 'none'} |",
            f"| ops without a deterministic kernel | "
            f"{', '.join(result['nondeterministic_ops']) or 'none'} |",
            f"| evaluate, KV cache: device vs CPU | {result['decoded']} decoded, "
            f"{len(result['decode_differences'])} different |",
            f"| export reloaded by transformers, max rel. logit diff | "
            f"{result['export_rel_diff']:.2e} |",
            f"| Whisper tiny.en + LoRA (dropout 0.1), compiled | loss {lora['first_loss']:.3f}"
            f" -> {lora['last_loss']:.3f}, {lora['decoded']} decoded, graphs {lora['graphs']} |",
            f"| speech + conversations + text, compiled | loss {mix['first_loss']:.3f} -> "
            f"{mix['last_loss']:.3f}, validation "
            f"{', '.join(f'{k} {v:.3f}' for k, v in mix['val_losses'].items())}, "
            f"graphs {mix['graphs']} |",
            f"| evaluate conversations and text, KV cache: device vs CPU | {mix['decoded']} "
            f"decoded, {len(mix['decode_differences'])} different |",
        ]
    elif part == "speed":
        lines += fast_path_lines(result)
        lines.append(f"| grouped GEMM, max rel. error | {result['grouped_gemm_rel_error']:.2e} |")
        lines += torchtitan_lines(result["torchtitan"])
    else:
        for model, stall in result["checkpoint_stall"].items():
            lines.append(f"| async checkpoint stall, {model} | {stall:.1%} of a sync save |")
    return "\n".join(lines)


def measurements(result: dict, s: dict) -> list[dict]:
    """The fast path's measured rows in the planner's table format
    (``orchestrator.planner.measured``): its fixed batches are priced."""
    date = datetime.date.today().isoformat()
    rows = []
    for r in result["fast_path"]:
        if "error" in r:
            continue
        utterances, seconds, tokens = s["batches"][r["batch"]]
        gpu = gpu_of_device(r.get("gpu", ""))
        plan = f"--model {s['fast_preset']} --seconds {seconds:g} --tokens {tokens}"
        plan += f" --global-batch {utterances} --gpus 1 --gpu {gpu.key if gpu else 'h100'}"
        plan += "" if r["compile"] else " --eager"
        on_gpu = gpu is not None
        rows.append(
            {
                "source": "bench/gpu_check.py (bench_fast_path)",
                "date": date,
                "hardware": r.get("gpu", s["device"]),
                "plan": plan,
                "layout": f"dp_shard=1 microbatches=1 ac={r['ac']}",
                "tokens_per_s_per_gpu": f"{r['tokens_per_s']:.1f}",
                "peak_memory_gib": f"{r['peak_reserved_gib']:.2f}" if on_gpu else "",
                "scope": PRICED if on_gpu else "out: measured on a CPU",
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--cpu", action="store_true", help="the reduced form, on the CPU")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check")
    parser.add_argument(
        "--fast-path",
        metavar="RUNS",
        help="the fast-path runs, e.g. compiled:selective:audio,eager:full:text (default: all "
        f"of eager|compiled x {'|'.join(AC_MODES)} x {'|'.join(BATCHES)})",
    )
    parser.add_argument("--train-steps", type=int, help="steps of the flows' trainings (even)")
    parser.add_argument("--host-syncs", choices=HOST_SYNC_MODES, help="default: error on a GPU")
    parser.add_argument("--whisper", type=Path, help="a Whisper tiny.en directory (packed or not)")
    args = parser.parse_args()
    s = settings(args.cpu)
    if args.fast_path:
        try:
            s["fast_path"] = [fast_path_run(item, s) for item in args.fast_path.split(",")]
        except ValueError as error:
            print(f"error: --fast-path: {error}")
            return 2
    if args.train_steps:
        s["steps"] = args.train_steps
    if args.host_syncs:
        s["host_syncs"] = args.host_syncs
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print(
                "error: no CUDA device; on a machine without one run: bash bench/gpu_check.sh --cpu"
            )
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    # On a GPU the default leaves the planner's calibration out (minutes); CI runs every part.
    default = PARTS if args.cpu else ("flows", "speed")
    parts = default if args.part == "all" else (args.part,)
    for part in parts:
        print(f"gpu_check: {part} on {s['device']} ...", flush=True)
        if part == "flows":
            corpus = [sys.executable, str(REPO / "recipes/make_corpus.py")]
            corpus += ["--out", str(args.out / "corpus"), "--num", str(s["corpus"]), "--tones"]
            run([*corpus, "--jobs", str(min(8, os.cpu_count() or 1))])
            result = part_flows(s, args.out, whisper_dir(args.whisper, args.out))
        elif part == "speed":
            result = part_speed(s, args.out)
            append(args.out / "measurements.csv", measurements(result, s))
        else:
            result = part_extra(s, args.out)
        (args.out / f"gpu_check_{part}.json").write_text(json.dumps(result, indent=1))
        print(table(part, result), flush=True)
    print(f"gpu_check: results in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
