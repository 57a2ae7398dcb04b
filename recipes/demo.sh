#!/usr/bin/env bash
# `make demo`: a 3-job chain run end to end, first on the local backend, then on a private SLURM
# cluster on loopback (2 nodes) started and stopped here. Every job prints its seed and rank
# layout; the summary at the end reads the chain's manifest and the jobs' own records.
set -euo pipefail
cd "$(dirname "$0")/.."

stamp=$(date +%Y%m%d-%H%M%S)
runs="$PWD/runs"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

chain_id() { python -c 'import json, sys; print(json.loads(sys.stdin.read().splitlines()[-1])["chain_id"])'; }

summarise() {
  python - "$1" <<'PY'
import json, sys
from pathlib import Path
run_dir = Path(sys.argv[1])
manifest = json.loads((run_dir / "manifest.json").read_text())
records = [json.loads(line) for line in (run_dir / "smoke.jsonl").read_text().splitlines()]
print(f"chain {manifest['chain_id']}: {len(manifest['jobs'])} jobs, run dir {run_dir}")
for job, record in zip(manifest["jobs"], records):
    seeds = ", ".join(str(seed) for seed in record["data_seeds"])
    print(f"  job {job['index']} (id {job['job_id']}): seed {job['seed']}, world size "
          f"{record['world_size']}, rank data seeds [{seeds}], steps {record['steps_done']}")
PY
}

echo "== 1/2: auto_launch -n3 recipes/smoke.sub on the local backend =="
local_run="$runs/demo-local-$stamp"
auto_launch -n3 --backend local --run-dir "$local_run" recipes/smoke.sub -- --steps 6 --sleep 0.2
for log in "$local_run"/logs/*.out; do echo "--- $log"; cat "$log"; done
summarise "$local_run"

echo
echo "== 2/2: auto_launch -n3 recipes/smoke_2node.yaml on a loopback SLURM cluster =="
cluster_dir="$runs/demo-cluster-$stamp"
orchestrator cluster up --dir "$cluster_dir" --nodes 2
trap 'orchestrator cluster down --dir "$cluster_dir"' EXIT
eval "$(orchestrator cluster env --dir "$cluster_dir")"
slurm_run="$runs/demo-slurm-$stamp"
chain=$(auto_launch -n3 --json --run-dir "$slurm_run" recipes/smoke_2node.yaml | chain_id)
orchestrator status "$chain"
echo "-- following the chain's logs until its last job ends"
orchestrator logs "$chain" --follow
orchestrator status "$chain"
summarise "$slurm_run"
