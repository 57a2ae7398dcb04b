"""The cluster for people and shells: ``cluster status`` (daemons, pids, node states) and
``cluster env`` (the line that points SLURM's commands at it)."""

from __future__ import annotations

import shlex
from pathlib import Path

from orchestrator.cluster.daemons import daemon_names, daemon_pids
from orchestrator.cluster.queries import node_states
from orchestrator.cluster.record import DB_DATA, ClusterInfo, load, resolve_dir
from orchestrator.errors import SchedulerError, UsageError
from orchestrator.processes import alive, process_name


def _require(directory: Path | str) -> ClusterInfo:
    path = resolve_dir(directory)
    info = load(path)
    if info is None or not Path(info.conf).is_file():
        raise UsageError(
            f"no cluster in {path}: start one with `orchestrator cluster up --dir {path}`"
        )
    return info


def env_line(directory: Path | str) -> str:
    """The shell line that points SLURM's commands at the cluster."""
    return f"export SLURM_CONF={shlex.quote(_require(directory).conf)}"


def status(directory: Path | str) -> str:
    """Conf path, daemons with their pids (alive or not) and node states, for people."""
    info = _require(directory)
    lines = [f"cluster: {info.directory}", f"conf:    {info.conf}"]
    if info.accounting:
        lines.append(
            f"accounting: slurmdbd on 127.0.0.1:{info.dbd_port}, "
            f"MariaDB in {Path(info.directory) / DB_DATA}"
        )
    else:
        lines.append("accounting: off (sacct has no records; `cluster up --accounting` adds it)")
    lines.append("daemons:")
    pids = daemon_pids(info.directory)
    for daemon in daemon_names(info):
        pid = pids.get(daemon)
        lines.append(f"  {daemon:<12} pid {pid or '-':<8} {'alive' if pid else 'not running'}")
    if info.munged_pid is not None:
        running = alive(info.munged_pid) and process_name(info.munged_pid) == "munged"
        owner = "started by this cluster" if info.started_munged else "already running"
        lines.append(
            f"  {'munged':<12} pid {info.munged_pid:<8} "
            f"{'alive' if running else 'not running'} ({owner})"
        )
    lines.append("nodes:")
    if pids.get("slurmctld") is None:
        lines.append("  unknown: slurmctld is not running")
        return "\n".join(lines)
    try:
        states = node_states(info.conf)
    except SchedulerError as error:
        lines.append(f"  unknown: {error}")
        return "\n".join(lines)
    lines += [
        f"  {node:<4} {states.get(node, 'missing'):<10} port {info.node_ports[node]}, "
        f"{info.cpus_per_node} CPUs"
        for node in info.nodes
    ]
    return "\n".join(lines)
