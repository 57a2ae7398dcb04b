"""A chained sweep at the scheduler's scale: M members x N links of a probe job queued as one job
array per link (orchestrator/arrays.py) against a chain of jobs per member (the path before,
``hydra.launcher.arrays=false``), in one run on the loopback cluster.

Each path submits the same sweep through ``orchestrator.sweep.submit_sweep`` (every member
planned from one code snapshot, its run dir and scripts written, everything queued: what the user
waits for), with the cluster's nodes drained so that no job starts while it is measured. For each
it prints the sbatch calls and the submission's wall seconds, then the scheduler commands one
``orchestrator status SWEEP`` issues and its seconds; the arrays' figures as ratios against the
chains'. SLURM's commands are counted by wrappers put first on PATH. Uses $SLURM_CONF when set,
else starts (and stops) a private cluster with `orchestrator cluster up`.

    python -m bench.bench_sweep_arrays [--members 200] [--links 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.loopback import bench_cluster
from tests.harness.cluster import calls_of, counted_slurm

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RESOURCES = {"template": "single", "time": "00:05:00", "cpus_per_task": 1}


def counting_path(directory: Path) -> Path:
    """SLURM's commands counted by the test harness's wrappers, first on this process's PATH."""
    env, calls = counted_slurm(directory)
    os.environ["PATH"] = env["PATH"]
    return calls


def taken(calls: Path) -> Counter[str]:
    """The commands recorded since the last call (``scontrol`` with its verb), then empty."""
    return Counter(calls_of(calls))


def nodes(state: str) -> None:
    names = subprocess.run(
        ["sinfo", "--noheader", "--format=%N"], capture_output=True, text=True, check=True
    ).stdout.split()
    for name in names:
        subprocess.run(
            ["scontrol", "update", f"NodeName={name}", f"State={state}", "Reason=bench"],
            check=True,
        )


def cancel_all() -> None:
    subprocess.run(["scancel", "--user", os.environ.get("USER", "root")], check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        queue = subprocess.run(
            ["squeue", "--noheader", "--array", "--format=%i"], capture_output=True, text=True
        ).stdout.split()
        if not queue:
            return
        time.sleep(0.5)


def one_path(work: Path, calls: Path, members: int, links: int, arrays: bool, round_: int) -> dict:
    from orchestrator.sweep import SweepMember, SweepRequest, new_sweep_id, submit_sweep

    name = "arrays" if arrays else "chains"
    base = work / f"{name}-{round_}"
    request = SweepRequest(
        sweep_id=new_sweep_id(f"bench-{name}"),
        job_name="probe",
        train_argv=("true",),
        resources=RESOURCES,
        num_jobs=links,
        dependency="afterany",
        backend="slurm",
        workdir=REPO,
        arrays=arrays,
    )
    sweep = [
        SweepMember(index=i, overrides=(f"+member={i}",), run_dir=base / str(i), base_seed=i)
        for i in range(members)
    ]
    taken(calls)
    started = time.perf_counter()
    manifests = submit_sweep(request, sweep)
    submit_s = time.perf_counter() - started
    submitted = taken(calls)
    assert sum(len(manifest.jobs) for manifest in manifests) == members * links
    started = time.perf_counter()
    status = subprocess.run(
        [str(BIN / "orchestrator"), "status", request.sweep_id, "--json"],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    status_s = time.perf_counter() - started
    assert status.returncode == 0, status.stderr
    chains = json.loads(status.stdout.strip().splitlines()[-1])["chains"]
    assert len(chains) == members
    looked = taken(calls)
    cancel_all()
    return {
        "sbatch": submitted["sbatch"],
        "submit_s": submit_s,
        "status_commands": sum(looked.values()),
        "status_kinds": dict(looked),
        "status_s": status_s,
    }


def median_of(runs: list[dict]) -> dict:
    """Each figure's median over the rounds (the command kinds of the first)."""
    figures = {
        key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "status_kinds"
    }
    return {**figures, "status_kinds": runs[0]["status_kinds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=200)
    parser.add_argument("--links", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="medians over this many")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-arrays-") as scratch:
        work = Path(scratch)
        os.environ.setdefault("ORCH_HOME", str(work / "orch_home"))
        with bench_cluster(work, nodes=2, cpus_per_node=4):
            calls = counting_path(work / "counted")
            cancel_all()
            nodes("DRAIN")
            runs: dict[bool, list[dict]] = {False: [], True: []}
            try:
                for round_ in range(args.rounds):  # alternating, the machine's drift shared
                    for arrays in (False, True) if round_ % 2 == 0 else (True, False):
                        run = one_path(work, calls, args.members, args.links, arrays, round_)
                        runs[arrays].append(run)
            finally:
                cancel_all()
                nodes("RESUME")
    chains, arrays = (median_of(runs[kind]) for kind in (False, True))
    print(
        f"a chained sweep of {args.members} members x {args.links} links of a probe job, "
        f"medians of {args.rounds} rounds"
    )
    print(f"{'':22}{'chains':>12}{'arrays':>12}{'ratio':>9}")
    for key, label in (
        ("sbatch", "sbatch calls"),
        ("submit_s", "submit seconds"),
        ("status_commands", "status: commands"),
        ("status_s", "status: seconds"),
    ):
        before, after = chains[key], arrays[key]
        print(f"{label:22}{before:>12.4g}{after:>12.4g}{after / before:>8.3f}x")
    print(f"status's commands, chains: {chains['status_kinds']}")
    print(f"status's commands, arrays: {arrays['status_kinds']}")


if __name__ == "__main__":
    main()
