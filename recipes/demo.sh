#!/usr/bin/env bash
# `make demo`: a 3-job chain of real training (tiny SALM, 2 ranks, FSDP2) that resumes across
# jobs, first on the local backend, then on a private 2-node SLURM cluster on loopback started
# and stopped here. Each job trains its share of the steps, saves a DCP checkpoint and exits;
# the next job resumes it with its own seed. A summary per chain ends each part. The local chain
# takes a few steps per job; the cluster's trains on 64 utterances of the corpus (its demo split)
# long enough (about a minute on 2 cores) to learn to transcribe them, and ends with an evaluation
# job on them (--then recipes/evaluate_demo.yaml) whose WER closes the demo, with a line on what
# it means.
set -euo pipefail
cd "$(dirname "$0")/.."

stamp=$(date +%Y%m%d-%H%M%S)
runs="$PWD/runs"
overrides=(train.max_steps=30 train.max_steps_per_run=10 checkpoint.interval=5)
learning=(data.split=demo train.max_steps=600 train.max_steps_per_run=200 checkpoint.interval=200)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export WANDB_MODE=${WANDB_MODE:-offline}

if [[ ! -f data/corpus/COMPLETE.json ]]; then
  echo "error: no corpus in data/corpus; run \`make corpus\` (make demo does)" >&2
  exit 2
fi

chain_id() { python -c 'import json, sys; print(json.loads(sys.stdin.read().splitlines()[-1])["chain_id"])'; }

summarise() {
  python - "$1" <<'PY'
import json, sys
from pathlib import Path
run_dir = Path(sys.argv[1])
manifest = json.loads((run_dir / "manifest.json").read_text())
metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
training = [job for job in manifest["jobs"] if not job.get("then")]
then = " and an evaluation job" if len(training) < len(manifest["jobs"]) else ""
print(f"\nchain {manifest['chain_id']} ({manifest['backend']}): {len(training)} training jobs{then}")
for job in manifest["jobs"]:
    if job.get("then"):
        continue
    rows = [m for m in metrics if str(m.get("job_index")) == str(job["index"]) and "loss" in m]
    if rows:
        print(f"  job {job['index']} (id {job['job_id']}, seed {job['seed']}): steps "
              f"{rows[0]['step']}..{rows[-1]['step']}, loss at its end {rows[-1]['loss']:.4f}, "
              f"{rows[-1]['tokens_per_s']:.0f} tokens/s")
    else:
        print(f"  job {job['index']} (id {job['job_id']}, seed {job['seed']}): no steps "
              "(training had already finished)")
checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
print(f"  checkpoints: {run_dir / 'checkpoints'} ({', '.join(checkpoints)})")
print(f"  metrics:     {run_dir / 'metrics.jsonl'}; logs: {run_dir / 'logs'}")
PY
}

echo "== 1/2: auto_launch -n3 recipes/train_tiny_fsdp2.yaml on the local backend =="
local_run="$runs/demo-local-$stamp"
auto_launch -n3 --backend local --run-dir "$local_run" recipes/train_tiny_fsdp2.yaml -- "${overrides[@]}"
grep -h "\[train\]" "$local_run"/logs/*.out || true
summarise "$local_run"

echo
echo "== 2/2: auto_launch -n3 recipes/train_tiny_2node.yaml on a 2-node loopback SLURM cluster =="
cluster_dir="$runs/demo-cluster-$stamp"
orchestrator cluster up --dir "$cluster_dir" --nodes 2 --cpus-per-node 2
trap 'orchestrator cluster down --dir "$cluster_dir"' EXIT
eval "$(orchestrator cluster env --dir "$cluster_dir")"
slurm_run="$runs/demo-slurm-$stamp"
# The demo split: the first 64 training utterances, few enough to learn in a minute.
python -c 'from lhotse import CutSet; CutSet.from_file("data/corpus/cuts_train.jsonl.gz").subset(first=64).to_file("data/corpus/cuts_demo.jsonl.gz")'
chain=$(auto_launch -n3 --json --run-dir "$slurm_run" --then recipes/evaluate_demo.yaml recipes/train_tiny_2node.yaml -- "${learning[@]}" | chain_id)
orchestrator status "$chain"
echo "-- following the chain's logs until its last job ends"
orchestrator logs "$chain" --follow | grep -E "^\[(orch|train)\]|^==>|error" || true
orchestrator status "$chain"
summarise "$slurm_run"
python - "$slurm_run" <<'PY'
import json, sys
from pathlib import Path
run_dir = Path(sys.argv[1])
summaries = sorted(run_dir.glob("eval/step_*/summary.json"), key=lambda p: int(p.parent.name[5:]))
if not summaries:
    sys.exit(f"error: the evaluation job wrote no summary in {run_dir / 'eval'}; see its log")
summary = json.loads(summaries[-1].read_text())
print(f"\nevaluation (--then recipes/evaluate_demo.yaml) at step {summary['step']}: "
      f"WER {100 * summary['wer']:.1f}%, CER {100 * summary['cer']:.1f}% on the "
      f"{summary['num_utterances']} utterances it trained on ({summary['split']} split)")
print("  what it means: the share of words it gets wrong transcribing speech it learnt from (a "
      "model that says nothing scores 100%); sentences it never heard need more data and steps "
      "(recipes/train_asr.yaml)")
print(f"  hypotheses: {summaries[-1].parent / 'hypotheses.jsonl'}")
PY
