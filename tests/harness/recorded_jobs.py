"""Recipes whose jobs record what they saw (their recipe, argv, the contract's ORCH_* variables,
start and end) in the run dir, and the checks of those records for a chain and its --then job."""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness.chains import write_sub

# Every job appends what it saw: its recipe, argv, the contract's ORCH_* variables, start and end.
RECORD_BODY = """
start=$(date +%s.%N)
sleep 1
python3 - "$recipe" "$start" "$@" <<'PY' >> "$ORCH_RUN_DIR/jobs.jsonl"
import json, os, sys, time
recipe, start, *argv = sys.argv[1:]
names = "CHAIN_ID JOB_INDEX NUM_JOBS SEED RUN_DIR SWEEP_ID".split()
env = {f"ORCH_{n}": os.environ[f"ORCH_{n}"] for n in names if f"ORCH_{n}" in os.environ}
line = {"recipe": recipe, "argv": argv, "env": env, "cwd": os.getcwd()}
print(json.dumps({**line, "start": float(start), "end": time.time()}))
PY
if [ "$ORCH_JOB_INDEX" = "${FAIL_AT:-none}" ]; then exit 3; fi
"""


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def recording_recipe(path: Path) -> Path:
    """A .sub whose jobs append what they saw to RUN_DIR/jobs.jsonl, named by ``path``'s stem."""
    return write_sub(path, f"recipe={path.stem}\n{RECORD_BODY.lstrip()}")


def recipes(tmp_path: Path) -> tuple[Path, Path]:
    """A chain recipe and a --then recipe."""
    return recording_recipe(tmp_path / "train.sub"), recording_recipe(tmp_path / "evaluate.sub")


def check_then_job_records(run_dir: Path, chain_id: str, seeds: list[int], args: list[str]) -> None:
    """Two chain jobs, then the --then job: after them, in the run dir, with the contract."""
    records = read_jsonl(run_dir / "jobs.jsonl")
    assert [r["recipe"] for r in records] == ["train", "train", "evaluate"]
    assert records[2]["start"] >= records[1]["end"], "the --then job overlapped the chain"
    assert records[2]["argv"] == [str(seeds[2]), *args]
    assert records[2]["cwd"] == records[0]["cwd"]
    assert records[2]["env"] == {
        "ORCH_CHAIN_ID": chain_id,
        "ORCH_JOB_INDEX": "2",
        "ORCH_NUM_JOBS": "2",
        "ORCH_SEED": str(seeds[2]),
        "ORCH_RUN_DIR": str(run_dir),
    }
