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
times also go to ``OUT/measurements.csv`` (columns ``MEASUREMENT_COLUMNS``), one row per
configuration, the format in which our own runs join the planner's table of published
measurements.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEASUREMENT_COLUMNS = (
    "source",
    "date",
    "model",
    "gpu",
    "gpus",
    "layout",
    "batch",
    "compile",
    "ac",
    "precision",
    "step_time_s",
    "tokens_per_s_per_gpu",
    "mfu",
    "peak_memory_gib",
)
STALL = re.compile(r"stall / synchronous save: ([0-9.]+)%")
GRAPHS = re.compile(r"compiled graphs per region: (.+) \(limit")


def settings(cpu: bool) -> dict:
    """Sizes for a GPU (llm_1b) or for the reduced CPU form (tiny)."""
    if cpu:
        return {
            "device": "cpu",
            "preset": "tiny",
            # compiled on the CPU: the entrypoint's run (a second inductor build costs ~30 s)
            "fast_path": [(False, "none")],
            "bench": ["--batch", "2", "--audio-seconds", "2", "--text-tokens", "16"],
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
        "fast_path": [(c, ac) for c in (False, True) for ac in ("none", "selective", "full")],
        "bench": [],
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
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... failed:\n{done.stderr[-3000:]}")
    return done


def fast_path(s: dict) -> list[dict]:
    rows = []
    for compile_, ac in s["fast_path"]:
        command = [sys.executable, str(REPO / "bench/bench_fast_path.py"), "--ac", ac]
        command += ["--preset", s["preset"], "--device", s["device"], *s["bench"]]
        command += [*s["bench_steps"], *(["--compile"] if compile_ else [])]
        result = json.loads(run(command).stdout.strip().splitlines()[-1])
        rows.append({"compile": compile_, "ac": ac, **result})
    return rows


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


def part_bench(s: dict) -> dict:
    return {
        "fast_path": fast_path(s),
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
            lines.append(f"| fast path, compile={r['compile']}, ac={r['ac']} | {figure} |")
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
    """Rows of our own measured step times, in the table format of ``MEASUREMENT_COLUMNS``."""
    common = {
        "source": "bench/gpu_check.py",
        "date": datetime.date.today().isoformat(),
        "model": s["preset"],
        "gpu": result.get("gpu", s["device"]),
        "gpus": s["nproc"],
        "layout": f"dp_shard={s['nproc']}",
        "precision": "fp32" if s["device"] == "cpu" else "bf16",
    }
    if part == "bench":
        return [
            {
                **common,
                "gpu": r.get("gpu", s["device"]),
                "gpus": 1,
                "layout": "dp_shard=1",
                "batch": " ".join(s["bench"]) or "8 x 20 s + 128 tokens",
                "compile": r["compile"],
                "ac": r["ac"],
                "step_time_s": r["step_time_s"],
                "tokens_per_s_per_gpu": r["tokens_per_s"],
                "mfu": r.get("mfu_datasheet"),
                "peak_memory_gib": r.get("peak_memory_gib"),
            }
            for r in result["fast_path"]
        ]
    return [
        {
            **common,
            "batch": next(o for o in s["train"] if o.startswith("data.max_duration")),
            "compile": True,
            "ac": "selective",
            "step_time_s": result["step_time_s"],
            "tokens_per_s_per_gpu": result["tokens_per_s"] / s["nproc"],  # over all ranks
            "mfu": result["mfu"],
            "peak_memory_gib": None,
        }
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=("bench", "train", "all"), default="all")
    parser.add_argument("--cpu", action="store_true", help="the reduced form, on the CPU")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check")
    args = parser.parse_args()
    s = settings(args.cpu)
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
        result = part_bench(s) if part == "bench" else part_train(s, args.out)
        (args.out / f"gpu_check_{part}.json").write_text(json.dumps(result, indent=1))
        csv_path = args.out / "measurements.csv"
        fresh = not csv_path.exists()
        with csv_path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=MEASUREMENT_COLUMNS)
            if fresh:
                writer.writeheader()
            writer.writerows(measurements(part, result, s))
        print(table(part, result), flush=True)
    print(f"gpu_check: results in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
