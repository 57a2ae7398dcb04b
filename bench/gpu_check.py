"""The GPU check: what a person with one GPU runs, with no network, to see the fast path work.

    bash bench/gpu_check.sh bench     # part 1 (<10 min on an H100): fast path, grouped GEMM, stall
    bash bench/gpu_check.sh train     # part 2 (<10 min): the real entrypoint, bf16 against fp32
    bash bench/gpu_check.sh --cpu     # both parts reduced (tiny preset, few steps): what CI runs

Part 1 makes nothing but measures: ``bench/bench_fast_path.py`` for ``llm_1b`` (eager and
compiled, each activation checkpointing mode: tokens/s, MFU against the datasheet peak and
against the bf16 matmul ceiling measured on this GPU, peak memory), the experts' grouped GEMM
with aligned groups against per-expert matmuls (bf16 on CUDA), and the async checkpoint stall
(``bench/bench_async_checkpoint.py``). Part 2 makes a synthetic corpus itself (tones, no
espeak-ng: ``recipes/make_corpus.py --tones``), trains ``llm_1b`` through ``python -m train``
with compile, selective activation checkpointing and validation (recompiles, tokens/s, MFU),
then the same steps eager in fp32, and compares the losses and validation losses. The reduced
CPU form trains the tiny preset on 2 gloo ranks, on a corpus whose first batches hold a single
utterance and whose validation batches hold one or two: it is the compiled path's end-to-end
test in CI (``tests/test_gpu_check.py``: no recompile-limit failure, 4 graphs per region, losses
equal to eager).

Each part prints one markdown table and writes ``OUT/gpu_check_<part>.json``; measured step
times also go to ``OUT/measurements.csv``, one row per configuration, in the columns of the
planner's table of published measurements (``orchestrator/planner/measured.py``): a row from an
H100 joins that table as it is, and ``orchestrator plan --measured OUT/measurements.csv`` prices
each row. Part 1 also runs ``bench/bench_kernels.py``: what this GPU's matmuls, attention and
memory reach, the figures the planner's step-time terms are calibrated with.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from contract.gpus import gpu_of_device  # noqa: E402
from orchestrator.planner.measured import PRICED, append  # noqa: E402

# Fast-path batches: (utterances, audio seconds, transcript tokens) per step.
BATCHES = {"audio": (8, 20.0, 128), "text": (4, 0.5, 2048)}
STALL = re.compile(r"stall / synchronous save: ([0-9.]+)%")
GRAPHS = re.compile(r"compiled graphs per region: (.+) \(limit")


def settings(cpu: bool) -> dict:
    """Sizes for a GPU (llm_1b) or for the reduced CPU form (tiny)."""
    if cpu:
        return {
            "device": "cpu",
            "preset": "tiny",
            # compiled on the CPU: the entrypoint's run (a second inductor build costs ~30 s)
            "fast_path": [(False, "none", "audio")],
            "batches": {"audio": (2, 2.0, 16)},
            "bench_steps": ["--steps", "2", "--warmup", "1"],
            "corpus": 64,
            "nproc": 2,  # FSDP2 over 2 gloo ranks, as the compiled-path test in CI asks
            "config": "tiny_fsdp2",
            "train": ["data.max_duration=5", "eval.max_duration=3.5", "data.num_workers=0"],
            "steps": 6,
            "eval_every": 3,
            "log_every": 2,
            "checkpoint_models": ["small"],
        }
    return {
        "device": "cuda",
        "preset": "llm_1b",
        "fast_path": [
            *((c, ac, "audio") for c in (False, True) for ac in ("none", "selective", "full")),
            *((c, "selective", "text") for c in (False, True)),
        ],
        "batches": BATCHES,
        "bench_steps": ["--steps", "10", "--warmup", "3"],
        "corpus": 2000,
        "nproc": 1,
        "config": "gpu_llm_1b",
        "train": [
            "parallel.tp=1",
            "data.max_duration=160",
            "eval.max_duration=160",
            "data.num_workers=4",
        ],
        "steps": 60,
        "eval_every": 30,
        "log_every": 10,
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
    rows = []
    for compile_, ac, batch in s["fast_path"]:
        utterances, seconds, tokens = s["batches"][batch]
        command = [sys.executable, str(REPO / "bench/bench_fast_path.py"), "--ac", ac]
        command += ["--preset", s["preset"], "--device", s["device"], "--batch", str(utterances)]
        command += ["--audio-seconds", str(seconds), "--text-tokens", str(tokens)]
        command += [*s["bench_steps"], *(["--compile"] if compile_ else [])]
        result = json.loads(run(command).stdout.strip().splitlines()[-1])
        rows.append({"compile": compile_, "ac": ac, "batch": batch, **result})
        print(f"gpu_check: fast path {json.dumps(rows[-1])}", flush=True)
    return rows


def fast_path_run(text: str, s: dict) -> tuple[bool, str, str]:
    """``compiled:selective:audio`` as (compile, ac, batch)."""
    parts = text.split(":")
    if (
        len(parts) != 3
        or parts[0] not in ("eager", "compiled")
        or parts[1] not in ("none", "selective", "full")
        or parts[2] not in s["batches"]
    ):
        raise ValueError(
            f"{text!r} is not eager|compiled:none|selective|full:{'|'.join(s['batches'])}"
        )
    return parts[0] == "compiled", parts[1], parts[2]


def kernels(s: dict, out: Path) -> dict:
    """bench/bench_kernels.py's figures (reduced on the CPU)."""
    command = [sys.executable, str(REPO / "bench/bench_kernels.py"), "--device", s["device"]]
    run(
        [
            *command,
            "--out",
            str(out / "kernels.json"),
            *(["--quick"] if s["device"] == "cpu" else []),
        ]
    )
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
    command = [sys.executable, str(REPO / "bench/bench_async_checkpoint.py"), "--saves", "3"]
    out = run([*command, "--models", *s["checkpoint_models"]]).stdout
    return dict(
        zip(s["checkpoint_models"], (float(v) / 100 for v in STALL.findall(out)), strict=True)
    )


def train(s: dict, out: Path, corpus: Path, name: str, *overrides: str) -> list[dict]:
    run_dir = out / name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={s['nproc']}"]
    command += ["-m", "train", "--config-name", s["config"], f"run_dir={run_dir}"]
    command += [f"data.corpus={corpus}", f"model.preset={s['preset']}", "wandb.enabled=false"]
    command += [f"train.max_steps={s['steps']}", f"train.log_every={s['log_every']}"]
    command += [f"eval.interval={s['eval_every']}", "checkpoint.interval=100000", "seed=5"]
    done = run([*command, *s["train"], *overrides], timeout=900)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    graphs = GRAPHS.search(done.stderr)
    return [*rows, {"graphs": graphs.group(1) if graphs else None}]


def part_bench(s: dict, out: Path) -> dict:
    return {
        "fast_path": fast_path(s),
        "kernels": kernels(s, out),
        "grouped_gemm_rel_error": grouped_gemm_error(s["device"]),
        "checkpoint_stall": checkpoint_stall(s),
    }


def max_rel_diff(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def part_train(s: dict, out: Path) -> dict:
    corpus = out / "corpus"
    command = [sys.executable, str(REPO / "recipes/make_corpus.py"), "--out", str(corpus)]
    run([*command, "--num", str(s["corpus"]), "--tones", "--jobs", str(min(8, os.cpu_count()))])
    fast = train(s, out, corpus, "compiled", "compile=true", "activation_checkpointing=selective")
    fp32 = train(s, out, corpus, "eager_fp32", "compile=false", "mixed_precision=false")
    losses = [[row["loss"] for row in rows if "loss" in row] for rows in (fast, fp32)]
    val_losses = [[row["val_loss"] for row in rows if "val_loss" in row] for rows in (fast, fp32)]
    logged = [row for row in fast if "tokens_per_s" in row]
    steady = logged[1:] or logged  # the first interval holds the compilation
    return {
        "steps": s["steps"],
        "recompiles": logged[-1].get("recompiles"),
        "graphs": fast[-1]["graphs"],
        "val_losses": val_losses[0],
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "step_time_s": sum(r["step_time_s"] for r in steady) / len(steady),
        "mfu": (sum(r["mfu"] for r in steady) / len(steady)) if "mfu" in steady[0] else None,
        "loss_rel_diff_vs_fp32": max_rel_diff(*losses),
        "val_loss_rel_diff_vs_fp32": max_rel_diff(*val_losses),
    }


def table(part: str, result: dict) -> str:
    lines = ["| what | figure |", "| --- | --- |"]
    if part == "bench":
        for r in result["fast_path"]:
            figure = f"{r['tokens_per_s']:.0f} tokens/s, {r['step_time_s']:.3f} s/step"
            if "mfu_datasheet" in r:
                figure += (
                    f", MFU {r['mfu_datasheet'] or 0:.1%} (datasheet) /"
                    f" {r['mfu_measured_ceiling']:.1%} (measured matmul ceiling"
                    f" {r['matmul_ceiling_tflops']:.0f} TFLOP/s), {r['peak_memory_gib']:.1f} GiB"
                )
            what = f"fast path ({r['batch']}), compile={r['compile']}, ac={r['ac']}"
            lines.append(f"| {what} | {figure} |")
        lines.append(f"| grouped GEMM, max rel. error | {result['grouped_gemm_rel_error']:.2e} |")
        for model, stall in result["checkpoint_stall"].items():
            lines.append(f"| async checkpoint stall, {model} | {stall:.1%} of a sync save |")
    else:
        mfu = "n/a" if result["mfu"] is None else f"{result['mfu']:.1%}"
        lines += [
            f"| entrypoint, {result['steps']} steps, compile + selective AC | "
            f"{result['tokens_per_s']:.0f} tokens/s, {result['step_time_s']:.3f} s/step, "
            f"MFU {mfu} |",
            f"| recompiles (graphs per region) | {result['recompiles']} ({result['graphs']}) |",
            f"| validation losses | {', '.join(f'{v:.4f}' for v in result['val_losses'])} |",
            f"| loss, compiled (bf16 on GPU) vs eager fp32, max rel. diff | "
            f"{result['loss_rel_diff_vs_fp32']:.2e} (validation "
            f"{result['val_loss_rel_diff_vs_fp32']:.2e}) |",
        ]
    return "\n".join(lines)


def measurements(part: str, result: dict, s: dict) -> list[dict]:
    """Our measured rows in the planner's table format (``orchestrator.planner.measured``): the
    fast path's fixed batches are priced; the entrypoint's run, whose batches vary with the
    corpus, is recorded but not priced."""
    date = datetime.date.today().isoformat()
    rows = []
    if part == "bench":
        for r in result["fast_path"]:
            utterances, seconds, tokens = s["batches"][r["batch"]]
            gpu = gpu_of_device(r.get("gpu", ""))
            plan = f"--model {s['preset']} --seconds {seconds:g} --tokens {tokens}"
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
    return [
        {
            "source": "bench/gpu_check.py (python -m train)",
            "date": date,
            "hardware": result.get("gpu", s["device"]),
            "plan": f"--model {s['preset']} --gpus {s['nproc']}",
            "layout": f"dp_shard={s['nproc']} microbatches=1 ac=selective",
            "tokens_per_s_per_gpu": f"{result['tokens_per_s'] / s['nproc']:.1f}",
            "peak_memory_gib": "",
            "scope": "out: batches of a real corpus vary in shape",
        }
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=("bench", "train", "all"), default="all")
    parser.add_argument("--cpu", action="store_true", help="the reduced form, on the CPU")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check")
    parser.add_argument(
        "--fast-path",
        metavar="RUNS",
        help="the fast-path runs, e.g. compiled:selective:audio,eager:full:text (default: all "
        f"of eager|compiled x none|selective|full x {'|'.join(BATCHES)} the part lists)",
    )
    parser.add_argument("--train-steps", type=int, help="steps of the entrypoint's runs")
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
        s["eval_every"] = max(1, args.train_steps // 2)
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print(
                "error: no CUDA device; on a machine without one run: bash bench/gpu_check.sh --cpu"
            )
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    parts = ("bench", "train") if args.part == "all" else (args.part,)
    for part in parts:
        print(f"gpu_check: {part} on {s['device']} ({s['preset']}) ...", flush=True)
        result = part_bench(s, args.out) if part == "bench" else part_train(s, args.out)
        (args.out / f"gpu_check_{part}.json").write_text(json.dumps(result, indent=1))
        append(args.out / "measurements.csv", measurements(part, result, s))
        print(table(part, result), flush=True)
    print(f"gpu_check: results in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
