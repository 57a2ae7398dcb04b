"""Many members' chains as SLURM job arrays (orchestrator/arrays.py) on the loopback cluster.

``auto_launch --members`` queues one array per link, as a Hydra chained sweep does
(tests/test_sweeps.py trains through that path). The members' jobs are probes run by the real
templates and chain hooks (tests/harness/workers/array_probe.py): each records its seed and
times, and ends the way its member is told, so that every rule a chain of its own follows is
checked on an array task: a failure not retried, a rank killed (retried), a save before the time
limit, and a batch shell killed with no end hook at all.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

import pytest

from contract.seeds import chain_seeds
from tests.harness.chains import wait_chain_quietly, write_sub
from tests.harness.cluster import calls_of, counted_slurm, queue_ids
from tests.harness.process import REPO, run_tool
from tests.harness.recorded_jobs import read_jsonl, recording_recipe

PROBE = REPO / "tests/harness/workers/array_probe.py"
MEMBERS, LINKS, SEED = 4, 2, 11


def probe_recipe(tmp_path: Path) -> Path:
    """A YAML recipe of the probe: a minute's limit, the stop asked for 40 s before it."""
    recipe = tmp_path / "probe.yaml"
    recipe.write_text(
        f'template: single\ntime: "00:01:00"\nsignal_grace: 40\n'
        f"command: [{sys.executable}, {PROBE}]\n"
    )
    return recipe


def sweep_of(stdout: str) -> str:
    match = re.search(r"^sweep (\S+):", stdout, re.MULTILINE)
    assert match, stdout
    return match.group(1)


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The largest number of ``(start, end)`` spans running at one moment."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


@pytest.mark.slurm
def test_each_member_runs_its_links_in_order_and_fails_alone(empty_queue, tmp_path):
    """4 members x 2 links and a --then job, at most 2 tasks of an array at once: 3 sbatch
    calls in all at launch. Member 0's first task dies with its batch shell (no end hook: it
    is judged and its next task freed by another member's start), member 1's fails (not
    retried: its next task still runs, as afterany would), member 2's is killed (retried: a
    replacement after its last task), member 3's saves and stops before its time limit. Every
    task runs once, each member's in order with the seeds of its plan, and each --then job
    after its member's last job; `status SWEEP` takes one look."""
    base = tmp_path / "runs"
    env, calls = counted_slurm(tmp_path / "counted")
    plan = {"0:0": "die", "1:0": "fail", "2:0": "kill", "3:0": "stop"}
    launched = run_tool(
        "auto_launch",
        f"-n{LINKS}",
        "--members",
        str(MEMBERS),
        "--seed",
        str(SEED),
        "--array-parallelism",
        "2",
        "--retries",
        "1",
        "--restarts-in-job",
        "0",
        "--then",
        str(recording_recipe(tmp_path / "evaluate.sub")),
        "--run-dir",
        str(base),
        "--code",
        "live",
        str(probe_recipe(tmp_path)),
        cwd=REPO,
        env={**env, "PROBE_PLAN": json.dumps(plan)},
    )
    assert launched.returncode == 0, launched.stderr
    sweep = sweep_of(launched.stdout)
    made = calls_of(calls)
    assert made.count("sbatch") == LINKS + 1, made  # the links and the --then jobs

    for member in range(MEMBERS):
        wait_chain_quietly(base / str(member), f"{sweep}-{member}", timeout=240)
    manifests = [json.loads((base / str(m) / "manifest.json").read_text()) for m in range(MEMBERS)]
    arrays = [job["job_id"].partition("_")[0] for job in manifests[0]["jobs"][: LINKS + 1]]
    bases = chain_seeds(MEMBERS, SEED)
    for member, manifest in enumerate(manifests):
        jobs = {job["index"]: job for job in manifest["jobs"]}
        seeds = chain_seeds(LINKS + 2, bases[member])  # the links, --then, a replacement
        for number, array in enumerate(arrays):
            assert jobs[number]["job_id"] == f"{array}_{member}"
            assert jobs[number]["seed"] == seeds[number]
        ran = read_jsonl(base / str(member) / "probe.jsonl")
        replaced = member in (0, 2)
        assert [r["index"] for r in ran] == [0, 1, 3] if replaced else [0, 1], ran
        assert [r["seed"] for r in ran] == [seeds[r["index"]] for r in ran]
        assert [r["job_id"] for r in ran] == [jobs[r["index"]]["job_id"] for r in ran]
        assert all(a["end"] <= b["start"] for a, b in itertools.pairwise(ran)), ran
        (then,) = read_jsonl(base / str(member) / "jobs.jsonl")
        assert then["argv"] == [str(seeds[LINKS])]
        assert then["start"] >= max(r["end"] for r in ran), (then, ran)
        outcome = jobs[0]["outcome"], jobs[0]["why"]
        assert outcome[0] == ("stopped" if member == 3 else "failed"), outcome
        assert jobs[1]["outcome"] == "completed", jobs[1]
        if replaced:
            assert jobs[3]["replaces"] == 0 and jobs[3]["outcome"] == "completed", jobs[3]
        else:
            assert 3 not in jobs, jobs
    assert "without running its end hook" in manifests[0]["jobs"][0]["why"]
    assert "not retried" in manifests[1]["jobs"][0]["why"]
    assert "SIGKILL" in manifests[2]["jobs"][0]["why"]
    for number in range(LINKS):
        spans = [
            (r["start"], r["end"])
            for m in range(MEMBERS)
            for r in read_jsonl(base / str(m) / "probe.jsonl")
            if r["index"] == number
        ]
        assert len(spans) == MEMBERS and most_at_once(spans) <= 2, spans

    calls_of(calls)
    status = run_tool("orchestrator", "status", sweep, "--json", env=env)
    assert status.returncode == 0, status.stderr
    made = calls_of(calls)
    assert all(made.count(call) == 1 for call in made), made
    assert {"squeue", "sacct"} >= {call for call in made if not call.startswith("scontrol")}
    chains = json.loads(status.stdout.strip().splitlines()[-1])["chains"]
    assert [len(chain["jobs"]) for chain in chains] == [4, 3, 4, 3]


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("options", "error"),
    [
        (["--members", "0"], "error: --members 0: give at least 1 replica"),
        (
            ["--members", "1002"],
            "error: the sweep's arrays need task ids up to 1001, and this cluster's MaxArraySize "
            "is 1001",
        ),
        (["--members", "2", "--array-parallelism", "0"], "error: --array-parallelism 0: give"),
        (["--array-parallelism", "2"], "error: --array-parallelism throttles the arrays of"),
        (["--members", "2", "ARRAY"], "sets '#SBATCH --array': a chained job is one job"),
    ],
    ids=["no-members", "over-max-array-size", "no-parallelism", "parallelism-alone", "own-array"],
)
def test_bad_member_requests_queue_nothing(empty_queue, tmp_path, options, error):
    """One line, exit 2, no run dir made and nothing queued."""
    recipe = str(probe_recipe(tmp_path))
    if "ARRAY" in options:
        own = write_sub(tmp_path / "own.sub", "echo $SEED\n", "#SBATCH --array=0-3")
        options = [str(own) if word == "ARRAY" else word for word in options]
    else:
        options = [*options, recipe]
    base = tmp_path / "runs"
    refused = run_tool("auto_launch", "--run-dir", str(base), "--code", "live", *options)
    assert refused.returncode == 2, refused.stderr
    assert error in refused.stderr, refused.stderr
    said = [line for line in refused.stderr.splitlines() if not line.startswith("backend: ")]
    assert len(said) == 1, refused.stderr  # the backend chosen, then the error alone
    assert not base.exists()
    assert queue_ids() == []
