"""``auto_launch``'s command line: its options, and the split of the toolkit's arguments from
the recipe's (after ``--``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator import remote
from orchestrator.backends import registry
from orchestrator.backends.base import DEPENDENCY_KINDS
from orchestrator.manifest import DEFAULT_MAX_STALLED, DEFAULT_RESTARTS_IN_JOB
from orchestrator.slow_nodes import DEFAULT_EXCLUDE_SLOW_NODES
from orchestrator.snapshot import DEFAULT_LIMIT_MB, SNAPSHOT


def auto_launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="auto_launch",
        description="Submit a chain of N jobs of a recipe; each job depends on the one before, "
        "gets its own seed as $1 and resumes the training the previous job left.",
        epilog="Arguments after -- are passed to the recipe after the seed.",
    )
    parser.add_argument(
        "recipe",
        help="a .sub batch script or a .yaml recipe description; a bare name that is not a file "
        "here (smoke.yaml) is a recipe shipped with the toolkit",
    )
    parser.add_argument("-n", "--num-jobs", type=int, default=1, help="jobs in the chain")
    parser.add_argument(
        "--dependency",
        default="afterany",
        choices=DEPENDENCY_KINDS,
        help="afterany (default): go on after any end; afterok: stop on a failure; singleton",
    )
    parser.add_argument("--seed", type=int, help="derive every job's seed from this one")
    parser.add_argument("--run-dir", type=Path, help="shared by the chain's jobs")
    parser.add_argument("--name", help="job name (default: the recipe's file name)")
    parser.add_argument(
        "--backend",
        default="auto",
        choices=registry.OPTIONS,
        help="auto (default): slurm when a controller answers, else local",
    )
    parser.add_argument(
        "--then",
        metavar="RECIPE",
        help="queue one more job of this recipe after the chain's last (afterany), in the same "
        "run dir with the next job index and seed: e.g. an evaluation",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        metavar="K",
        help="queue a replacement job (new seed) at the end of the chain for each job that "
        "fails in a way a new job can fix (node failure, preemption, a hang, a rank killed, "
        "the time limit before a save, a code of --retry-on-exit), up to K in all (slurm or "
        "local backend, where it runs at once; the recipe must run the chain hook, as rendered "
        "YAML recipes do)",
    )
    parser.add_argument(
        "--retry-on-exit",
        default="",
        metavar="CODES",
        help="exit codes (comma-separated) that also earn a replacement under --retries, e.g. "
        "1 for a command of your own whose failures are transient",
    )
    parser.add_argument(
        "--max-stalled",
        type=int,
        default=DEFAULT_MAX_STALLED,
        metavar="N",
        help="stop the chain (status stalled, its queued jobs cancelled) after N jobs in a row "
        "end without a newer complete checkpoint; 0: never (default %(default)s)",
    )
    parser.add_argument(
        "--restarts-in-job",
        type=int,
        default=DEFAULT_RESTARTS_IN_JOB,
        metavar="K",
        help="launch the training again inside the same job, from the newest checkpoint, when "
        "it fails in a way a new process fixes (a hang, a lost peer, a rank killed, a code of "
        "--retry-on-exit) and the job has a checkpoint interval's time left, up to K times; "
        "the same failure twice, or a job the cluster ended, goes to --retries (slurm backend, "
        "YAML recipes; default %(default)s)",
    )
    parser.add_argument(
        "--exclude-slow-nodes",
        type=int,
        default=DEFAULT_EXCLUDE_SLOW_NODES,
        metavar="N",
        help="leave a node the trainer named slow (train.straggler) out of the chain's later "
        "jobs (their --exclude), up to N nodes at once, while its partition keeps enough "
        "others; 0: never (slurm backend; default %(default)s)",
    )
    parser.add_argument(
        "--readmit-slow-nodes",
        type=int,
        default=0,
        metavar="K",
        help="a node left out as slow may run the chain's jobs again K jobs after the one that "
        "named it; 0: never (default)",
    )
    parser.add_argument(
        "--code",
        default=SNAPSHOT,
        metavar="snapshot|live|DIR",
        help="what the jobs run: snapshot (default) freezes the git work tree holding the "
        "current directory (tracked files with their uncommitted changes, untracked files git "
        "does not ignore) into RUN_DIR/code, and every job runs that copy; live: the tree as it "
        "is when each job starts; DIR: that directory. The jobs get it as ORCH_CODE_DIR",
    )
    parser.add_argument(
        "--code-limit-mb",
        type=float,
        default=DEFAULT_LIMIT_MB,
        metavar="MB",
        help="refuse a snapshot larger than this (default %(default)g)",
    )
    parser.add_argument(
        "--members",
        type=int,
        metavar="M",
        help="M replicas of the recipe, each a chain of its own with its own seeds (derived "
        "from --seed where given) in RUN_DIR/<member>; on SLURM each link of all members is "
        "one job array. Look after them as a sweep: orchestrator status|cancel|logs SWEEP",
    )
    parser.add_argument(
        "--array-parallelism",
        type=int,
        metavar="P",
        help="with --members on SLURM: at most P tasks of each array run at once",
    )
    parser.add_argument("--dry-run", action="store_true", help="print, submit nothing")
    parser.add_argument("--json", action="store_true", help="end with a JSON summary line")
    parser.add_argument(
        "--no-plan-check",
        action="store_true",
        help="queue a training recipe even when the planner says its layout cannot fit",
    )
    remote.add_host_options(parser, launch=True)
    return parser


def split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []
