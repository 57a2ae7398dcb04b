"""The real speech LLM learns on one GPU and keeps what it knew: one table.

    python -m bench.speech_chat_pack                 # here: .gpu/speech_chat.parts/ (see there)
    bash bench/gpu_speech_chat.sh [--minutes 3]      # there, in the call that carries the last part
    bash bench/gpu_speech_chat.sh --cpu --data D     # reduced, on the CPU (what CI runs)

On the GPU, bench/gpu_speech_chat.sh checks the carried parts against their ``SHA256SUMS``,
unpacks them and installs the pack's wheels; this then converts
SmolLM2-135M-Instruct's GGUF as `make pretrained` does (logits checked against the GGUF-loaded
model), widens Whisper tiny.en's encoder back to fp32, then runs:

- ``base``: the base LLM's answers to the held-out capitals (transformers' greedy ``generate`` on
  the converted folder, scored as ``train.evaluate`` scores: after its default normalizer, an
  answer right when it equals the reference);
- ``chat``: recipes/conf/salm_speech_chat.yaml (ASR, spoken questions, capitals) for
  ``--minutes`` of training, then ``train.evaluate`` on the held-out test sets;
- ``no_text``: the same without the capitals, the run that shows what the text keeps;
- ``baseline``: recipes/conf/asr_whisper.yaml (the same frozen encoder under a byte-level
  decoder trained from scratch), saved every 50 steps: its first checkpoint to have drawn as many
  ASR cuts as ``chat`` did is the one evaluated (the table shows both counts).

The three trainings run side by side on the one GPU (each a small model on small batches), the
base model's answers meanwhile, then the three evaluations side by side: about ``--minutes`` plus
start-up, compilation and decoding (not yet timed on a GPU), within one device call.

It prints one markdown table against Whisper tiny.en's own zero-shot WER on the same audio
(``anchor.json``, measured when packing) and the issue's targets, and writes
``OUT/gpu_speech_chat.json``. ``--cpu`` runs every part for 2 steps on a small pack's data
(``bench.speech_chat_pack.make_data`` with a limit) and the local ``make pretrained`` folders.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.gpu_flows import evaluate, metrics, run
from bench.gpu_pack import WHISPER, unpack_whisper
from bench.launcher import torchrun
from bench.speech_chat_pack import GGUF, anchor
from contract.run_dir import CUTS_PREFIX
from recipes.pretrained import DEFAULT_OUT, SMOLLM2
from train.checkpoint.location import completed, newest_step

REPO = Path(__file__).resolve().parents[1]
PARTS = ("base", "chat", "no_text", "baseline")
# The targets: ASR below the anchor and within 1.5x of the baseline's WER; spoken
# questions >= 90% right; capitals after training >= 0.95x the base model's.
BASELINE_RATIO, SPOKEN_RIGHT, KEPT = 1.5, 0.9, 0.95


def say(line: str) -> None:
    print(f"gpu_speech_chat: {line}", file=sys.stderr, flush=True)


def settings(cpu: bool, minutes: float) -> dict:
    """What each training and evaluation runs with, on the GPU or reduced on the CPU."""
    if cpu:
        return {
            "device": "cpu",
            "limits": ["train.max_steps=2", "train.log_every=1"],
            "train": ["data.max_duration=4", "data.num_workers=0", "eval.interval=0"],
            "chat": [],  # the save at max_steps
            "baseline": ["checkpoint.interval=1", "checkpoint.keep=100"],
            "evaluate": ["max_new_tokens=24", "batch_size=4"],
        }
    return {
        "device": "cuda",
        "limits": ["train.max_steps=100000", f"train.max_time_per_run={60 * minutes:g}"],
        "train": [
            "data.max_duration=60",
            "data.num_workers=4",
            "eval.interval=0",
            "train.log_every=50",
            "compile=true",
        ],
        "chat": ["checkpoint.interval=100000"],  # the save at the time budget's end
        "baseline": ["checkpoint.interval=50", "checkpoint.keep=1000"],
        "evaluate": ["max_new_tokens=48", "batch_size=32"],
    }


def convert_llm(gguf: Path, out: Path) -> Path:
    """SmolLM2's GGUF converted and checked as `make pretrained` does it, into ``out``."""
    from recipes.pretrained import smollm2

    if not (out / "model.safetensors").is_file():
        model, tokenizer = smollm2.convert(gguf, out)
        for finding in smollm2.check(out, model, tokenizer):
            say(f"SmolLM2 converted: {finding}")
    return out


def text_pairs(folder: Path, name: str) -> list[tuple[str, str]]:
    questions = (folder / f"{name}.src.txt").read_text().splitlines()
    answers = (folder / f"{name}.tgt.txt").read_text().splitlines()
    return list(zip(questions, answers, strict=True))


def base_rate(llm: Path, pairs: list[tuple[str, str]], device: str) -> dict:
    """The base LLM's share of ``pairs`` answered exactly (greedy, after train.evaluate's
    default normalizer), and its replies."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.pretrained.smollm2 import greedy_reply
    from train.eval.normalizers import DEFAULT_NORMALIZER, normalizer
    from train.eval.wer import ErrorCounts, edit_counts

    model = AutoModelForCausalLM.from_pretrained(llm, dtype=torch.float32).eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(llm)
    normalize, counts, replies = normalizer(DEFAULT_NORMALIZER), ErrorCounts(), []
    for question, answer in pairs:
        reply = greedy_reply(model, tokenizer, question, max_new_tokens=24)
        counts += edit_counts(normalize(answer), normalize(reply))
        replies.append({"question": question, "reference": answer, "reply": reply})
    return {"right": 1 - counts.ser, "answers": len(pairs), "replies": replies}


def asr_cuts_by_step(run_dir: Path) -> dict[int, int]:
    """The ASR cuts ``run_dir`` drew up to each logged step."""
    drawn, total = {}, 0
    for row in metrics(run_dir):
        if "loss" in row:
            total += row.get(f"{CUTS_PREFIX}asr", 0)
            drawn[row["step"]] = total
    return drawn


def train(s: dict, out: Path, name: str, config: str, *overrides: str) -> dict:
    """``python -m train`` of ``config`` into ``out/name``: its steps, ASR cuts and seconds."""
    run_dir = out / name
    command = [*torchrun(1), "-m", "train", "--config-name", config, f"run_dir={run_dir}"]
    command += ["wandb.enabled=false", "seed=1", *s["limits"], *s["train"], *overrides]
    started = time.perf_counter()
    run(command, out / f"{name}.log", env=device_env(s), timeout=1800)
    rows = [row for row in metrics(run_dir) if "loss" in row]
    return {
        "run_dir": str(run_dir),
        "steps": newest_step(run_dir),  # the time budget's save, past the last logged step
        "asr_cuts": max(asr_cuts_by_step(run_dir).values()),
        "seconds": time.perf_counter() - started,
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
    }


def device_env(s: dict) -> dict:
    return {"CUDA_VISIBLE_DEVICES": ""} if s["device"] == "cpu" else {}


def scores(s: dict, out: Path, name: str, test_sets: Path, *overrides: str) -> dict:
    """``train.evaluate`` of ``out/name`` on ``test_sets``: each set's WER and share right."""
    summary = evaluate(out / name, out / f"{name}_eval.log", s["device"], f"sets={test_sets}",
                       *s["evaluate"], *overrides)["summary"]  # fmt: skip
    sets = summary.get("sets", {"asr": summary})
    return {set_name: {"wer": f["wer"], "right": 1 - f["ser"]} for set_name, f in sets.items()}


def run_parts(s: dict, parts: list[str], data: Path, whisper: Path, llm: Path, out: Path) -> dict:
    """The chosen parts: the trainings side by side (one GPU holds all three: each is a small
    model on small batches), the base model's answers meanwhile, then the evaluations."""
    chats = data / "conversations"
    pretrained = [f"model.pretrained_encoder={whisper}", f"model.pretrained_llm={llm}"]
    chat_sets = f"eval.sets={chats / 'speech_chat_eval_sets.yaml'}"
    runs = {
        "chat": ["salm_speech_chat", *pretrained, chat_sets, *s["chat"],
                 f"data.input_cfg={chats / 'speech_chat_input_cfg.yaml'}"],
        "no_text": ["salm_speech_chat", *pretrained, chat_sets, *s["chat"],
                    f"data.input_cfg={chats / 'speech_chat_no_text_input_cfg.yaml'}"],
        # Saved as often as it logs, so that the checkpoint at the chat's ASR cuts is there.
        "baseline": ["asr_whisper", f"model.pretrained_encoder={whisper}",
                     f"data.input_cfg={chats / 'asr_input_cfg.yaml'}",
                     f"eval.sets={chats / 'asr_eval_sets.yaml'}", *s["baseline"]],
    }  # fmt: skip
    runs = {part: args for part, args in runs.items() if part in parts}
    results: dict = {}
    with ThreadPoolExecutor(max(1, len(runs))) as pool:
        say(f"training {', '.join(runs) or 'nothing'}")
        trained = {part: pool.submit(train, s, out, part, *args) for part, args in runs.items()}
        if "base" in parts:
            say("the base LLM on the held-out capitals")
            results["base"] = base_rate(llm, text_pairs(chats, "capitals_test"), s["device"])
        results.update({part: future.result() for part, future in trained.items()})
    if "baseline" in results:
        target = results.get("chat", {}).get("asr_cuts")
        results["baseline"].update(at_cuts(out / "baseline", target))
    test_sets = {"chat": "speech_chat_test_sets", "no_text": "speech_chat_test_sets",
                 "baseline": "asr_test_sets"}  # fmt: skip
    with ThreadPoolExecutor(max(1, len(runs))) as pool:
        say(f"evaluating {', '.join(runs) or 'nothing'}")
        tested = {}
        for part in runs:
            at = [f"step={results[part]['steps']}"] if part == "baseline" else []
            sets = chats / f"{test_sets[part]}.yaml"
            tested[part] = pool.submit(scores, s, out, part, sets, *at)
        for part, future in tested.items():
            results[part]["test"] = future.result()
    return results


def at_cuts(run_dir: Path, target: int | None) -> dict:
    """The first of ``run_dir``'s checkpoints to have drawn ``target`` ASR cuts (the last, when
    none has, or when there is no target): its step and the cuts drawn up to it."""
    drawn = asr_cuts_by_step(run_dir)
    saved = list(completed(run_dir))
    chosen = next((step for step in saved if target and drawn.get(step, 0) >= target), saved[-1])
    return {"steps": chosen, "asr_cuts": drawn.get(chosen, max(drawn.values()))}


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(results: dict, anchor_wer: float) -> list[str]:
    """The markdown table, then each target's verdict."""
    lines = [
        "| model | trained | ASR cuts | ASR test WER | spoken questions right | capitals right |",
        "|---|---|---|---|---|---|",
        f"| Whisper tiny.en zero-shot (anchor) | - | - | {percent(anchor_wer)} | - | - |",
    ]
    base = results.get("base")
    if base:
        lines.append(f"| SmolLM2-135M-Instruct (base) | - | - | - | - | {percent(base['right'])} |")
    names = {"chat": "speech chat", "no_text": "speech chat without text",
             "baseline": "asr_whisper (byte decoder)"}  # fmt: skip
    for part, name in names.items():
        if part not in results:
            continue
        r, test = results[part], results[part]["test"]
        lines.append(
            f"| {name} | {r['steps']} steps, {r['seconds'] / 60:.1f} min | {r['asr_cuts']:,} | "
            f"{percent(test['asr']['wer'])} | {percent(test.get('spoken', {}).get('right'))} | "
            f"{percent(test.get('capitals', {}).get('right'))} |"
        )
    return lines + verdicts(results, anchor_wer)


def verdicts(results: dict, anchor_wer: float) -> list[str]:
    if "chat" not in results:
        return []
    test = results["chat"]["test"]
    wer = test["asr"]["wer"]
    lines = [f"- ASR: {percent(wer)} against the anchor's {percent(anchor_wer)}: "
             + ("below" if wer < anchor_wer else "NOT below")]  # fmt: skip
    if "baseline" in results:
        ratio = wer / max(results["baseline"]["test"]["asr"]["wer"], 1e-9)
        lines.append(f"- ASR against the baseline: {ratio:.2f}x (target <= {BASELINE_RATIO}x)")
    right = test["spoken"]["right"]
    lines.append(f"- spoken questions: {percent(right)} (target >= {percent(SPOKEN_RIGHT)})")
    if "base" in results and results["base"]["right"] > 0:
        kept = test["capitals"]["right"] / results["base"]["right"]
        lines.append(f"- capitals kept: {kept:.2f}x the base model's (target >= {KEPT}x)")
        if "no_text" in results:
            alone = results["no_text"]["test"]["capitals"]["right"] / results["base"]["right"]
            lines.append(f"- capitals kept without text in the mixture: {alone:.2f}x")
    return lines


def prepare_gpu(pack: Path) -> tuple[Path, Path, Path, float]:
    """Convert and widen what the unpacked ``pack`` holds; (data, whisper, llm, anchor WER)."""
    llm = convert_llm(pack / GGUF, pack.parent / SMOLLM2.name)
    whisper = unpack_whisper(pack / WHISPER, pack.parent / f"{WHISPER}-fp32")
    return pack / "data", whisper, llm, anchor_of(pack / "anchor.json")


def anchor_of(path: Path) -> float:
    results = json.loads(path.read_text())["results"]
    return results["asr"]["scores"]["basic"]["all"]["wer"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="every part reduced, on the CPU")
    parser.add_argument("--minutes", type=float, default=3.0, help="training minutes a run")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {','.join(PARTS)}")
    parser.add_argument("--pack", type=Path, help="the unpacked pack (gpu_speech_chat.sh's)")
    parser.add_argument("--data", type=Path, help="--cpu: a made data folder (make_data)")
    parser.add_argument("--pretrained", type=Path, default=REPO / DEFAULT_OUT)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    args = parser.parse_args()
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS) or args.minutes <= 0:
        parser.error(f"--parts takes names of {','.join(PARTS)}; --minutes must be positive")
    if args.cpu and args.data is None:
        parser.error("--cpu needs --data: a folder bench.speech_chat_pack.make_data made")
    if not args.cpu and args.pack is None:
        parser.error("--pack: the unpacked pack; run bench/gpu_speech_chat.sh, which unpacks it")
    s = settings(args.cpu, args.minutes)
    if args.cpu:
        whisper, llm = args.pretrained / WHISPER, args.pretrained / SMOLLM2.name
        anchor(whisper, args.data, args.out / "anchor.json")
        data, anchor_wer = args.data, anchor_of(args.out / "anchor.json")
    else:
        data, whisper, llm, anchor_wer = prepare_gpu(args.pack)
    # On the GPU the run folders (checkpoints) stay on the machine; their logs come back in OUT.
    runs = args.out / "speech_chat_runs" if args.cpu else args.pack.parent / "runs"
    if runs.exists():
        shutil.rmtree(runs)
    runs.mkdir(parents=True)
    try:
        results = run_parts(s, parts, data, whisper, llm, runs)
    finally:
        if not args.cpu:
            for log in runs.glob("*.log"):
                shutil.copy2(log, args.out / log.name)
    lines = table(results, anchor_wer)
    print("\n".join(lines))
    device = "cpu" if args.cpu else gpu_name()
    about = {"device": device, "minutes": args.minutes, "anchor_wer": anchor_wer}
    record = {**about, "results": results, "table": lines}
    (args.out / "gpu_speech_chat.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


def gpu_name() -> str:
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout.strip() or "cuda"


if __name__ == "__main__":
    sys.exit(main())
