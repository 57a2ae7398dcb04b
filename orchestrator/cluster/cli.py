"""``orchestrator cluster up|down|env|status``: the subcommand the ``orchestrator`` program
registers (``orchestrator.cli.main``)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from orchestrator.cluster.config import PREEMPT_GRACE_S, URGENT_PARTITION
from orchestrator.cluster.lifecycle import DEFAULT_CPUS_PER_NODE, DEFAULT_NODES, down, up
from orchestrator.cluster.record import default_dir, say
from orchestrator.cluster.status import env_line, status


def _cmd_up(args: argparse.Namespace) -> int:
    info = up(
        args.dir,
        args.nodes,
        args.cpus_per_node,
        accounting=args.accounting,
        preemption=args.preemption,
    )
    say(f"cluster up: {info.shape()}; point SLURM at it with:")
    say(f"  eval $(orchestrator cluster env --dir {shlex.quote(info.directory)})")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    down(args.dir)
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    print(env_line(args.dir))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    print(status(args.dir))
    return 0


def add_cluster_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``cluster up|down|env|status`` on the ``orchestrator`` command."""
    parser = subparsers.add_parser(
        "cluster", help="a private SLURM cluster on loopback for trying recipes and for tests"
    )
    actions = parser.add_subparsers(dest="cluster_command", required=True)

    def add(name: str, handler, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help_text)
        sub.add_argument(
            "--dir",
            type=Path,
            default=default_dir(),
            help="where the cluster keeps its conf, state and logs (default: $ORCH_HOME/cluster)",
        )
        sub.set_defaults(handler=handler)
        return sub

    start = add(
        "up",
        _cmd_up,
        "start the cluster (or restart only its dead daemons, keeping the queue) and wait "
        "until every node takes jobs",
    )
    start.add_argument("--nodes", type=int, help=f"node daemons to start (default {DEFAULT_NODES})")
    start.add_argument(
        "--cpus-per-node",
        type=int,
        help=f"CPUs each node offers, may exceed the real ones (default {DEFAULT_CPUS_PER_NODE})",
    )
    start.add_argument(
        "--accounting",
        action=argparse.BooleanOptionalAction,
        help="run slurmdbd with a private MariaDB under --dir, so sacct knows finished jobs "
        "(default: off for a new cluster, as recorded for a running one)",
    )
    start.add_argument(
        "--preemption",
        action=argparse.BooleanOptionalAction,
        help=f"add a partition {URGENT_PARTITION!r} whose jobs preempt those of the default "
        f"one (PreemptMode=REQUEUE, GraceTime={PREEMPT_GRACE_S} s), as on shared clusters "
        "(default: off for a new cluster, as recorded for a running one)",
    )
    add("down", _cmd_down, "stop the daemons this cluster started and remove its state")
    add("env", _cmd_env, "print `export SLURM_CONF=...` for a shell")
    add("status", _cmd_status, "nodes, daemons and pids")
