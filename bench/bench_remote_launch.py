"""What ``auto_launch --host`` costs over plain ``ssh HOST auto_launch``, on a login node that
shares nothing with the laptop.

The login node is tests/harness/login_node.py's: OpenSSH on 127.0.0.1 where a second Unix user
logs in, with the toolkit installed from the wheel, submitting to a loopback cluster. The project
is a clone of this repository with a hand-written .sub beside it (a realistic code size). Each
round times, alternating so that both see the same load:

- ``ssh auto_launch`` (the baseline): the code is already on the host (a copy the first launch
  left there, as a user's ``git pull`` would), and ``ssh HOST 'cd COPY && auto_launch -n2 ...'``
  submits a 2-job chain;
- ``auto_launch --host``: the same chain from the laptop: the version check, the code sent, the
  launch, the manifest read back.

Seconds from the command's start to its return (the chain queued). Needs root (the cluster, the
second user: ``make setup-system``). Uses $SLURM_CONF when set (a cluster every user can
reach), else starts (and stops) a private cluster.

    python -m bench.bench_remote_launch [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.loopback import bench_cluster
from orchestrator.remote import Remote
from tests.harness.chains import write_sub
from tests.harness.login_node import HOST, login_node

REPO = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent
RECIPE = "bench_remote.sub"


def project(work: Path) -> Path:
    """A clone of this repository (unreadable to the login node's user) with the .sub beside."""
    tree = work / "project"
    subprocess.run(["git", "clone", "-q", "--local", str(REPO), str(tree)], check=True)
    tree.chmod(0o700)
    write_sub(tree / RECIPE, "echo seed $SEED\n")
    return tree


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    started = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    work.chmod(0o755)  # the private cluster's folder in it: every user's jobs run from its spool
    tree = project(work)
    env = {**os.environ, "ORCH_HOME": str(work / "home")}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    with bench_cluster(work, nodes=1, cpus_per_node=2) as conf, login_node(Path(conf)) as node:
        env.update(node.env, SLURM_CONF=conf)
        os.environ.update(node.env)  # Remote's ssh command
        host_launch = [
            str(BIN / "auto_launch"), "--host", HOST, "--remote-dir",
            node.remote_path("copies"), "-n2", RECIPE,
        ]  # fmt: skip
        timed(host_launch, tree, env)  # leaves the copy the plain ssh launches run in
        [copy] = (node.area / "copies").iterdir()
        body = f"cd {shlex.quote(str(copy))} && auto_launch -n2 {RECIPE}"
        plain = Remote(HOST, str(node.bin_dir)).ssh_argv(body)
        times: dict[str, list[float]] = {"ssh auto_launch": [], "auto_launch --host": []}
        for index in range(args.rounds):
            times["ssh auto_launch"].append(timed(plain, tree, env))
            times["auto_launch --host"].append(timed(host_launch, tree, env))
            print(
                f"round {index + 1}/{args.rounds}: "
                + ", ".join(f"{name} {values[-1]:.2f} s" for name, values in times.items()),
                flush=True,
            )
        subprocess.run(["scancel", "--user", node.user], env=env, check=False)
    sent = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=tree, capture_output=True, text=True
    ).stdout.count("\n")
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"\nproject: a clone of this repository, {sent} files sent per --host launch")
    print("| launch of a 2-job chain | median s | ratio to ssh auto_launch |")
    print("| --- | ---: | ---: |")
    for name, median in medians.items():
        print(f"| {name} | {median:.2f} | {median / medians['ssh auto_launch']:.2f} |")


if __name__ == "__main__":
    main()
