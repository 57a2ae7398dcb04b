"""The GPU check's flows: what a user runs, end to end, through the toolkit's own entrypoints.

Five trainings start together (the GPU is shared: these are checks, not timings), each
``python -m train`` with validation, asynchronous checkpoints, deterministic kernels and the
host-sync check over every step after the second. "Compiled" is inductor on a GPU, dynamo and
AOT autograd alone (``aot_eager``) in the CPU form:

- ``whole``: compiled with selective activation checkpointing, bf16 on a GPU;
- ``chain``: the same as two jobs of half the steps each, the second resumed from the first's
  checkpoint: its losses, gradient norms and validation losses must equal ``whole``'s bitwise;
- ``fp32``: eager in fp32, the reference the compiled bf16 losses are compared with;
- ``whisper_lora``: the real Whisper tiny.en encoder (frozen) under the preset decoder with
  LoRA adapters (peft's layers, dropout 0.1 on their input), compiled with selective
  checkpointing (the recompute keeps the forward's masks), then decoded by ``train.evaluate``;
- ``mixture``: compiled bf16 on speech, NeMo multimodal conversations (one or two audio turns,
  audio opening or in the middle of a conversation) and text-only pairs mixed by weight
  (tests/harness/conversations.py), batches of one, two and no audio turns per sequence,
  validated per set.

Then ``train.evaluate`` decodes the chain's checkpoint, and the mixture's conversations and
text sets, with the KV cache on the device and on the CPU, both in fp32: the hypotheses must be
equal. A near-tie (two tokens whose logits differ by
less than the devices' rounding) could pick a different token; none is expected of a model
whose decisions are this far apart, so every difference is reported and fails the check, to be
looked at. Last, ``train.export`` writes the chain as Hugging Face files, and ``transformers``
loads the LLM on the device and computes the logits the trained model computes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.launcher import torchrun
from tests.harness.conversations import conversation_mixture

REPO = Path(__file__).resolve().parents[1]
# Tokens decoded per utterance: enough to compare the devices' decisions, few enough that the
# CPU's fp32 decoding of the test split stays short.
MAX_NEW_TOKENS = 48
GRAPHS = re.compile(r"compiled graphs per region: (.+) \(limit")
HOST_SYNC = re.compile(r"^(\S+:\d+): UserWarning: called a synchronizing CUDA operation", re.M)
# What use_deterministic_algorithms(warn_only=True) and cuDNN say of a kernel that is not.
NONDETERMINISTIC = re.compile(
    r"UserWarning: (\S+) does not have a deterministic implementation"
    r"|UserWarning: (.+?) defaults to a non-deterministic algorithm"
)


def run(command: list[str], log: Path, env: dict | None = None, timeout: float = 900) -> str:
    """Run ``command`` from the repository root; its stderr (kept in ``log``), or an error
    naming the command and the end of its output."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled", **(env or {})}
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout
    )
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:8])} ... failed ({log}):\n{done.stderr[-3000:]}")
    return done.stderr


def train(
    s: dict, out: Path, name: str, *overrides: str, nproc: int | None = None, log: str = ""
) -> str:
    """``python -m train`` into ``out/name``; its stderr (kept in ``out/<log or name>.log``)."""
    steps = s["steps"]
    command = [*torchrun(nproc or s["nproc"]), "-m", "train", "--config-name", "tiny_fsdp2"]
    command += [f"run_dir={out / name}", f"data.corpus={out / 'corpus'}", "wandb.enabled=false"]
    command += [f"model.preset={s['preset']}", f"train.max_steps={steps}", "train.log_every=1"]
    command += [f"eval.interval={steps // 2}", f"checkpoint.interval={max(2, steps // 4)}"]
    command += ["checkpoint.async_save=true", "seed=5", "debug.deterministic=true"]
    command += [f"debug.host_syncs={s['host_syncs']}", *s["train"], *overrides]
    return run(command, out / f"{log or name}.log", timeout=1200)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in rows if key in row}


def max_rel_diff(got: dict[int, float], want: dict[int, float]) -> float:
    return max(abs(got[step] - want[step]) / abs(want[step]) for step in got)


def evaluate(run_dir: Path, log: Path, device: str, *overrides: str) -> dict:
    """``train.evaluate`` of ``run_dir`` on ``device`` ("cuda" or "cpu", fp32 either way):
    its summary and hypotheses by utterance (``set/utterance`` where ``sets=`` names sets)."""
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
    command = [sys.executable, "-m", "train.evaluate", f"run_dir={run_dir}", "batch_size=8"]
    command += [f"max_new_tokens={MAX_NEW_TOKENS}", *overrides]
    run(command, log, env=env)
    [summary] = list((run_dir / "eval").glob("step_*/summary.json"))
    return {"summary": json.loads(summary.read_text()), "hypotheses": decoded(run_dir)}


def decoded(run_dir: Path) -> dict[str, str]:
    """The hypotheses ``train.evaluate`` wrote for ``run_dir``, by ``set/utterance``."""
    [summary] = list((run_dir / "eval").glob("step_*/summary.json"))
    hypotheses = {}
    for path in summary.parent.rglob("hypotheses.jsonl"):
        where = path.parent.relative_to(summary.parent)
        for row in map(json.loads, path.read_text().splitlines()):
            hypotheses[str(where / row["id"])] = row["hypothesis"]
    return hypotheses


def differences(device: dict[str, str], cpu: dict[str, str]) -> list[str]:
    """The utterances decoded differently by two evaluations, or by one only."""
    return sorted(k for k in device.keys() | cpu.keys() if device.get(k) != cpu.get(k))


def export_agrees(run_dir: Path, folder: Path, device: str) -> float:
    """The exported LLM, loaded by transformers on ``device``, against the trained model's LLM
    in fp32 on the CPU: the largest logit difference relative to the largest logit."""
    import torch
    from transformers import AutoModelForCausalLM

    from train.checkpoint.saved_run import find_checkpoint, saved_model, saved_state
    from train.export import load_trained
    from train.parallel.layout import model_of

    checkpoint = find_checkpoint(run_dir, None, None)
    shape = model_of(saved_model(checkpoint, saved_state(checkpoint)))
    ours = load_trained(run_dir, checkpoint, shape)
    theirs = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype="float32")
    theirs.to(device)
    tokens = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5, 64]], device="cpu")
    with torch.no_grad():
        mask = torch.ones_like(tokens, dtype=torch.bool)
        expected, _ = ours.llm(ours.llm.embed(tokens), mask)
        got = theirs(tokens.to(device)).logits[:, :, : shape.vocab_size].cpu()
    return float((got - expected).abs().max() / expected.abs().max())


def host_syncs(*logs: str) -> list[str]:
    """The code sites CUDA named as host syncs (``debug.host_syncs=warn``), once each."""
    return sorted({site for log in logs for site in HOST_SYNC.findall(log)})


def part_flows(s: dict, out: Path, whisper: Path) -> dict:
    steps = s["steps"]
    compiled = [
        "compile=true",
        f"compile_backend={s['compile_backend']}",
        "activation_checkpointing=selective",
    ]
    whisper_run = [
        *compiled,
        f"model.pretrained_encoder={whisper}",
        "model.projector_stride=2",
        "model.freeze=[encoder\\..*]",
        "model.lora.rank=8",
        "model.lora.dropout=0.1",
        "train.encoder_cache_mb=1024",  # as recipes/conf/asr_whisper.yaml runs it
    ]

    mixture, sets = conversation_mixture((out / "corpus").resolve(), out / "mixture_data")
    mixture_run = [*compiled, f"data.input_cfg={mixture}", f"eval.sets={sets}"]
    job = [*compiled, f"train.max_steps_per_run={steps // 2}"]

    def chain() -> list[str]:
        return [train(s, out, "chain", *job, log=f"chain_job{n}") for n in (1, 2)]

    with ThreadPoolExecutor(5) as pool:
        whole = pool.submit(train, s, out, "whole", *compiled)
        chained = pool.submit(chain)
        fp32 = pool.submit(train, s, out, "fp32", "compile=false", "mixed_precision=false")
        lora = pool.submit(train, s, out, "whisper_lora", *whisper_run, nproc=1)
        mixed = pool.submit(train, s, out, "mixture", *mixture_run)
        logs = {"whole": whole.result(), "fp32": fp32.result(), "whisper_lora": lora.result()}
        logs["chain"] = "\n".join(chained.result())
        logs["mixture"] = mixed.result()

    names = ("whole", "chain", "fp32", "whisper_lora", "mixture")
    runs = {name: metrics(out / name) for name in names}
    resumed = {k: v for k, v in by_step(runs["chain"], "loss").items() if k > steps // 2}
    whole_losses = by_step(runs["whole"], "loss")
    bitwise = {
        key: all(by_step(runs["chain"], key)[k] == by_step(runs["whole"], key)[k] for k in resumed)
        for key in ("loss", "grad_norm")
    }
    val_chain, val_whole = by_step(runs["chain"], "val_loss"), by_step(runs["whole"], "val_loss")
    bitwise["val_loss"] = all(val_chain[k] == val_whole[k] for k in val_whole)

    for name in ("chain", "mixture"):
        ignore = shutil.ignore_patterns("eval")
        shutil.copytree(out / name, out / f"{name}_cpu", ignore=ignore)
    with ThreadPoolExecutor(5) as pool:
        on_device = pool.submit(evaluate, out / "chain", out / "eval_device.log", s["device"])
        on_cpu = pool.submit(evaluate, out / "chain_cpu", out / "eval_cpu.log", "cpu")
        lora_eval = pool.submit(evaluate, out / "whisper_lora", out / "eval_lora.log", s["device"])
        mix_device, mix_cpu = (
            pool.submit(evaluate, out / name, out / f"eval_{name}.log", device, f"sets={sets}")
            for name, device in (("mixture", s["device"]), ("mixture_cpu", "cpu"))
        )
        chain_device, lora_result = on_device.result(), lora_eval.result()
        chain_differences = differences(chain_device["hypotheses"], on_cpu.result()["hypotheses"])
        mix_result = mix_device.result()
        mix_differences = differences(mix_result["hypotheses"], mix_cpu.result()["hypotheses"])
    export = out / "chain_export"
    command = [sys.executable, "-m", "train.export", str(out / "chain"), "--out", str(export)]
    run(command, out / "export.log")

    lora_losses = list(by_step(runs["whisper_lora"], "loss").values())
    mix_losses = list(by_step(runs["mixture"], "loss").values())
    mix_val = [row for row in runs["mixture"] if "val_loss" in row][-1]
    last = [row for row in runs["whole"] if "recompiles" in row][-1]
    graphs = GRAPHS.search(logs["whole"])
    return {
        "steps": steps,
        "resumed_steps": len(resumed),
        "bitwise": bitwise,
        "loss_rel_diff_vs_fp32": max_rel_diff(whole_losses, by_step(runs["fp32"], "loss")),
        "val_losses": list(val_whole.values()),
        "val_loss_rel_diff_vs_fp32": max_rel_diff(val_whole, by_step(runs["fp32"], "val_loss")),
        "recompiles": last["recompiles"],
        "graphs": graphs.group(1) if graphs else None,
        "host_syncs": host_syncs(*logs.values()),
        "nondeterministic_ops": sorted(
            {"".join(op) for log in logs.values() for op in NONDETERMINISTIC.findall(log)}
        ),
        "decoded": len(chain_device["hypotheses"]),
        "decode_differences": chain_differences,
        "export_rel_diff": export_agrees(out / "chain", export / "llm", s["device"]),
        "whisper_lora": {
            "first_loss": lora_losses[0],
            "last_loss": lora_losses[-1],
            "decoded": len(lora_result["hypotheses"]),
            "wer": lora_result["summary"].get("wer"),
            "graphs": (GRAPHS.search(logs["whisper_lora"]) or [None, None])[1],
        },
        "mixture": {
            "first_loss": mix_losses[0],
            "last_loss": mix_losses[-1],
            "val_losses": {k: v for k, v in mix_val.items() if k.startswith("val_loss")},
            "graphs": (GRAPHS.search(logs["mixture"]) or [None, None])[1],
            "decoded": len(mix_result["hypotheses"]),
            "decode_differences": mix_differences,
        },
    }
