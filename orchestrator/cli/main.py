"""``orchestrator``: look after chains (list, status, cancel, logs, plot), and the planner's and
the loopback cluster's subcommands."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from contract.slurm_states import has_ended
from orchestrator import __version__, remote
from orchestrator.backends import registry
from orchestrator.backends.base import Backend
from orchestrator.chain import last_first
from orchestrator.chain_status import chain_status
from orchestrator.cli.chain_view import jobs_label, looked_at, print_table
from orchestrator.cli.follow_logs import cmd_logs
from orchestrator.cli.program import run_program, say
from orchestrator.cli.status_view import cmd_status
from orchestrator.manifest import (
    CANCELLED,
    MANIFEST_NAME,
    SUBMITTED,
    Manifest,
    chain_lock,
    find_manifests,
    list_chains,
    list_sweeps,
    member_manifest,
    orch_home,
)


def cmd_list(args: argparse.Namespace) -> int:
    entries = []  # (entry, its manifest or None where the file is missing), in listing order
    for entry in list_chains():
        path = Path(entry["run_dir"]) / MANIFEST_NAME
        entries.append((entry, Manifest.load(path) if path.is_file() else None))
    # Running, queued, or ended unjudged here (a chain launched with --host keeps a local copy
    # of its manifest, its jobs on the host): asked about, all in one look.
    asked = [
        manifest
        for entry, manifest in entries
        if manifest and manifest.status == SUBMITTED and not entry.get("host")
    ]
    looked = {
        manifest.chain_id: chain_status(manifest, statuses).status
        for manifest, (_, statuses) in zip(asked, looked_at(asked), strict=True)
    }
    rows = []
    for entry, manifest in entries:
        if manifest is None:
            rows.append([entry["chain_id"], "?", "?", "manifest missing", entry["run_dir"]])
            continue
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(manifest.created))
        where = f"{entry['host']}:" if entry.get("host") else ""
        rows.append(
            [
                manifest.chain_id,
                manifest.backend,
                jobs_label(manifest),
                looked.get(manifest.chain_id, manifest.status),
                created,
                where + manifest.run_dir,
            ]
        )
    if not rows:
        print(f"no chains under {orch_home()}")
        return 0
    print_table(rows, ["chain", "backend", "jobs", "status", "created", "run_dir"])
    sweeps = list_sweeps()
    if sweeps:
        print()
        print_table(
            [[entry["sweep_id"], str(len(entry["members"]))] for entry in sweeps],
            ["sweep", "members"],
        )
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    if args.member is None:
        manifests = find_manifests(args.chain)
    else:
        manifests = [member_manifest(args.chain, args.member)]
    looked = list(zip(manifests, looked_at(manifests), strict=True))
    # The chains of one scheduler (backends sharing its look) are cancelled in one command,
    # each chain's jobs last first: a sweep of 200 members is one scancel, not 200.
    to_cancel: dict[object, tuple[Backend, list[str]]] = {}
    lives = []
    for manifest, (backend, statuses) in looked:
        live = [job_id for job_id, status in statuses.items() if not has_ended(status.state)]
        scheduler = registry.by_label(manifest.backend).look_at or manifest.chain_id
        to_cancel.setdefault(scheduler, (backend, []))[1].extend(last_first(live))
        lives.append(live)
    for backend, job_ids in to_cancel.values():
        backend.cancel(job_ids)
    for (manifest, _), live in zip(looked, lives, strict=True):
        with chain_lock(Path(manifest.run_dir)):  # the hooks judge no more jobs of it
            current = Manifest.load(manifest.path)
            if current.status == SUBMITTED:
                current.status, current.ended = CANCELLED, f"cancelled by hand ({len(live)} job(s))"
                current.save()
        print(f"chain {manifest.chain_id}: cancelled {len(live)} job(s) {' '.join(live)}".rstrip())
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from orchestrator.plot import default_output, draw, plot_data

    data = plot_data(args.chain)
    out = draw(data, args.output or default_output(args.chain))
    for chain_id in data.without_metrics:
        say(f"chain {chain_id}: no metrics yet, left out")
    print(out)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from orchestrator.dashboard import load_spec, save_workspace

    spec = load_spec(args.spec)
    print(save_workspace(spec, entity=args.entity, project=args.project, name=args.name))
    return 0


def on_host(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``status``, ``logs`` and ``cancel`` of a chain on a login node (``--host``, or the host
    a chain launched with ``auto_launch --host`` lives on) run there over ssh."""

    def run(args: argparse.Namespace) -> int:
        where = remote.remote_for(args)
        if where is None:
            return handler(args)
        forwarded = remote.forwarded_argv(orchestrator_parser(), args.argv)
        return remote.run_command(where, args, forwarded)

    return run


def orchestrator_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrator", description="Look after chains of jobs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="chains launched from this machine")
    listing.set_defaults(handler=cmd_list)
    status = commands.add_parser("status", help="per job: id, seed, state, nodes")
    status.add_argument("chain", help="chain id, sweep id or run dir")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=on_host(cmd_status))
    cancel = commands.add_parser("cancel", help="cancel a chain's unfinished jobs")
    cancel.add_argument("chain")
    cancel.add_argument(
        "--member",
        type=int,
        metavar="I",
        help="of a sweep, only member I (0-based); the others go on",
    )
    cancel.set_defaults(handler=on_host(cmd_cancel))
    logs = commands.add_parser("logs", help="print (or --follow) a chain's job logs")
    logs.add_argument("chain")
    logs.add_argument("--job", type=int, help="only job K (0-based)")
    logs.add_argument("--follow", action="store_true", help="stream until the jobs finish")
    logs.set_defaults(handler=on_host(cmd_logs))
    for command in (status, cancel, logs):
        remote.add_host_options(command)
    plot = commands.add_parser("plot", help="loss and tokens/s against step, as a PNG")
    plot.add_argument("chain", help="chain id, sweep id or run dir")
    plot.add_argument(
        "-o",
        "--output",
        type=Path,
        help="PNG to write (default: RUN_DIR/plot.png for a chain, "
        "$ORCH_HOME/sweeps/<id>.png for a sweep)",
    )
    plot.set_defaults(handler=cmd_plot)
    dashboard = commands.add_parser(
        "dashboard", help="create the W&B workspace of the shipped dashboard spec (online)"
    )
    dashboard.add_argument("--entity", required=True, help="W&B user or team")
    dashboard.add_argument("--project", required=True, help="W&B project (the trainer's: speechlm)")
    dashboard.add_argument("--name", help="workspace name (default: the spec's)")
    dashboard.add_argument("--spec", type=Path, help="dashboard spec (default: the shipped one)")
    dashboard.set_defaults(handler=cmd_dashboard)
    from orchestrator.planner.arguments import add_plan_parser
    from orchestrator.planner.cli import cmd_plan

    add_plan_parser(commands)
    commands.choices["plan"].set_defaults(handler=cmd_plan)
    from orchestrator.cluster.cli import add_cluster_parser

    add_cluster_parser(commands)
    return parser


def orchestrator_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = orchestrator_parser().parse_args(argv)
    args.argv = argv
    return run_program(args.handler, args)
