"""Bringing the cluster up, repairing it and taking it down.

``up`` on a cluster whose daemons partly died restarts only the dead ones: slurmctld recovers its
queue from the state directory and a restarted slurmd brings its node back, so queued work is never
lost. A change that would need a new cluster (another shape, accounting switched) is refused, with
the jobs it would destroy named; ``down`` is the one command that wipes a cluster.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import socket
import time
from dataclasses import asdict
from pathlib import Path

from orchestrator.cluster.config import free_ports, write_confs
from orchestrator.cluster.daemons import (
    PID_FILE_GRACE_S,
    UP_TIMEOUT_S,
    daemon_names,
    daemon_pids,
    log_tails,
    marked_pids,
    require_binaries,
    start_daemon,
)
from orchestrator.cluster.munge import ensure_munged, munged_pids, slurm_daemons_elsewhere
from orchestrator.cluster.queries import cancel_all_jobs, node_states, query, queue_summary
from orchestrator.cluster.record import (
    CONF_NAME,
    DB_SOCKET,
    DBD_CONF_NAME,
    RECORD_NAME,
    STATE_ENTRIES,
    ClusterInfo,
    load,
    resolve_dir,
    say,
)
from orchestrator.errors import SchedulerError, UsageError
from orchestrator.manifest import atomic_write_json
from orchestrator.processes import alive, process_name, terminate, with_descendants
from orchestrator.retry import is_transient

DEFAULT_NODES = 2
DEFAULT_CPUS_PER_NODE = 1
# Node states that will not turn idle by themselves (a config the node cannot meet).
STUCK_STATES = ("inval", "drained", "draining", "fail", "failing")
# Node states (sinfo %T) of a node that takes or runs jobs.
SERVING_STATES = ("idle", "mixed", "allocated", "completing")
# slurmd puts unix sockets named <node>_<job>.<step> in its spool dir; their paths must fit in
# sun_path (108 bytes), which bounds how deep the cluster directory may be.
SOCKET_NAME_ROOM = 32
SUN_PATH_MAX = 107


def _wait_until_serving(info: ClusterInfo, timeout_s: float, restarted: list[str]) -> None:
    """Poll sinfo until every node takes jobs; fail early when a daemon has died.

    A ``restarted`` node that its registration left DOWN (ReturnToService covers the usual
    causes) is resumed, once SLURM takes it, so a restarted slurmd always brings its node back.
    """
    directory = Path(info.directory)
    started = time.monotonic()
    last_report = ""
    to_resume = set(restarted)
    while True:
        elapsed = time.monotonic() - started
        dead = [name for name, pid in daemon_pids(directory).items() if pid is None]
        try:
            states = node_states(info.conf, retry=False)
            report = ", ".join(f"{node} {states.get(node, 'missing')}" for node in info.nodes)
        except SchedulerError as error:
            if not is_transient(str(error)):
                raise
            states, report = {}, "waiting for slurmctld to answer"
        if all(states.get(node) in SERVING_STATES for node in info.nodes):
            say(f"nodes up: {report}")
            return
        if report != last_report:
            say(f"  {report}")
            last_report = report
        for node in sorted(to_resume & {node for node, state in states.items() if state == "down"}):
            try:
                query(["scontrol", "update", f"nodename={node}", "state=resume"], info.conf)
                to_resume.discard(node)
            except SchedulerError as error:
                # Refused while a job lost with the node is still completing on it: the next
                # poll asks again.
                if "Invalid node state specified" not in str(error):
                    raise
        stuck = [node for node in info.nodes if states.get(node) in STUCK_STATES]
        if elapsed > timeout_s or stuck or (dead and elapsed > PID_FILE_GRACE_S):
            why = f"daemons not running: {', '.join(dead)}" if dead else f"nodes: {report}"
            raise SchedulerError(
                f"the cluster in {directory} did not come up after {elapsed:.0f} s ({why}); "
                "its logs end:\n"
                f"{log_tails(directory)}"
            )
        time.sleep(0.5)


def _check_dir_depth(directory: Path, nodes: list[str]) -> None:
    longest = max(len(str(directory / "spool" / node)) for node in nodes) + SOCKET_NAME_ROOM
    longest = max(longest, len(str(directory / DB_SOCKET)))
    if longest > SUN_PATH_MAX:
        raise UsageError(
            f"cluster dir {directory} is too deep for slurmd's unix sockets "
            f"(paths must stay under {SUN_PATH_MAX} bytes); pick a shorter --dir"
        )


def up(
    directory: Path | str,
    nodes: int | None = None,
    cpus_per_node: int | None = None,
    timeout_s: float = UP_TIMEOUT_S,
    accounting: bool | None = None,
    preemption: bool | None = None,
) -> ClusterInfo:
    """Start the cluster, find it running, or restart the daemons of it that died; return once
    every node takes jobs.

    ``nodes``/``cpus_per_node``/``accounting``/``preemption`` left None take the defaults for a
    new cluster (accounting and preemption off) and accept any shape of a recorded one; given,
    they must match it.
    """
    if (nodes is not None and nodes < 1) or (cpus_per_node is not None and cpus_per_node < 1):
        raise UsageError("--nodes and --cpus-per-node must be at least 1")
    if os.geteuid() != 0:
        raise UsageError("cluster up runs slurmd and munged, which need root; run it as root")
    path = resolve_dir(directory)
    existing = load(path)
    if existing is not None:
        _check_same_shape(existing, nodes, cpus_per_node, accounting, preemption)
        return _repair(existing, require_binaries(existing.accounting), timeout_s)
    if marked_pids(path) or any((path / entry).exists() for entry in STATE_ENTRIES):
        say(f"leftovers of a cluster without a record in {path}: removing them")
        down(path)
    binaries = require_binaries(bool(accounting))
    nodes = nodes or DEFAULT_NODES
    cpus_per_node = cpus_per_node or DEFAULT_CPUS_PER_NODE
    node_names = [f"n{index}" for index in range(1, nodes + 1)]
    _check_dir_depth(path, node_names)
    started_munged, munged_pid = ensure_munged(binaries["munged"])
    ports = free_ports(nodes + 2)
    info = ClusterInfo(
        directory=str(path),
        conf=str(path / CONF_NAME),
        hostname=socket.gethostname(),
        nodes=node_names,
        cpus_per_node=cpus_per_node,
        controller_port=ports[0],
        node_ports=dict(zip(node_names, ports[2:], strict=True)),
        started_munged=started_munged,
        munged_pid=munged_pid,
        accounting=bool(accounting),
        dbd_port=ports[1] if accounting else None,
        preemption=bool(preemption),
    )
    for sub in ("state", "pid", "log", "db", *(f"spool/{node}" for node in node_names)):
        (path / sub).mkdir(parents=True, exist_ok=True)
    for log in (path / "log").glob("*"):
        log.unlink()
    write_confs(info)
    atomic_write_json(path / RECORD_NAME, asdict(info))
    say(f"starting {info.shape()} in {path} (slurmctld on port {info.controller_port})")
    try:
        for daemon in daemon_names(info):
            start_daemon(info, daemon, binaries)
        _wait_until_serving(info, timeout_s, restarted=[])
    except BaseException:
        down(path)
        raise
    return info


def _check_same_shape(
    existing: ClusterInfo,
    nodes: int | None,
    cpus_per_node: int | None,
    accounting: bool | None,
    preemption: bool | None,
) -> None:
    """Refuse a change that only a new cluster could make: it would wipe the queue."""
    wanted = dataclasses.replace(
        existing,
        nodes=[f"n{index}" for index in range(1, (nodes or len(existing.nodes)) + 1)],
        cpus_per_node=cpus_per_node or existing.cpus_per_node,
        accounting=existing.accounting if accounting is None else accounting,
        preemption=existing.preemption if preemption is None else preemption,
    )
    if wanted.shape() == existing.shape():
        return
    path = existing.directory
    if daemon_pids(path).get("slurmctld") is not None:
        lost = f"its queue ({queue_summary(existing.conf)})"
    else:
        lost = f"the queue saved in {Path(path) / 'state'} (slurmctld is down: jobs not listed)"
    raise UsageError(
        f"the cluster in {path} has {existing.shape()}, not {wanted.shape()}: that needs a new "
        f"cluster, which would wipe {lost}. Keep it with `orchestrator cluster up --dir "
        f"{shlex.quote(path)}` (restarts what died), or replace it: `orchestrator cluster down "
        f"--dir {shlex.quote(path)}` first"
    )


def _repair(info: ClusterInfo, binaries: dict[str, str], timeout_s: float) -> ClusterInfo:
    """Restart only the daemons of a recorded cluster that died, keeping its queue: slurmctld
    recovers it from StateSaveLocation, the live daemons are left alone."""
    path = Path(info.directory)
    if not munged_pids():
        info.started_munged, info.munged_pid = ensure_munged(binaries["munged"])
        atomic_write_json(path / RECORD_NAME, asdict(info))
        say(f"munged was not running: started it (pid {info.munged_pid})")
    pids = daemon_pids(path)
    dead = [daemon for daemon in daemon_names(info) if pids.get(daemon) is None]
    if not dead:
        say(f"cluster already running in {path}")
        return info
    if not Path(info.conf).is_file() or (info.accounting and not (path / DBD_CONF_NAME).is_file()):
        write_confs(info)
    for sub in ("state", "pid", "log", "db", *(f"spool/{node}" for node in info.nodes)):
        (path / sub).mkdir(parents=True, exist_ok=True)
    alive_ones = [f"{daemon} (pid {pid})" for daemon, pid in pids.items() if pid is not None]
    say(
        f"cluster in {path}: restarting {', '.join(dead)}; "
        f"left running: {', '.join(alive_ones) or 'none'}; the queue is kept"
    )
    for daemon in dead:
        start_daemon(info, daemon, binaries)
    restarted = [daemon.removeprefix("slurmd-") for daemon in dead if daemon.startswith("slurmd-")]
    _wait_until_serving(info, timeout_s, restarted)
    say(f"queue: {queue_summary(info.conf)}")
    return info


def down(directory: Path | str) -> bool:
    """Stop what this cluster started and remove its state; False when nothing was there."""
    path = resolve_dir(directory)
    info = load(path)
    daemons = daemon_pids(path)
    if info is not None and daemons.get("slurmctld") is not None:
        try:
            cancel_all_jobs(info.conf)
        except SchedulerError as error:
            say(f"could not cancel the jobs left in the queue: {error}")
    roots = [pid for pid in daemons.values() if pid is not None]
    pids = with_descendants([*roots, *marked_pids(path)])
    leftovers = [entry for entry in STATE_ENTRIES if (path / entry).exists()]
    if not pids and not leftovers:
        say(f"no cluster in {path}: nothing to stop")
        return False
    terminate(pids)
    if info is not None and info.started_munged and info.munged_pid is not None:
        _stop_munged(path, info.munged_pid)
    for entry in leftovers:
        target = path / entry
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
    stopped = f"stopped pids {' '.join(map(str, pids))}" if pids else "no daemon was running"
    say(f"cluster in {path} is down ({stopped}); logs kept in {path / 'log'}")
    return True


def _stop_munged(directory: Path, pid: int) -> None:
    """Stop the munged this cluster started, unless other slurm daemons still rely on it."""
    if process_name(pid) != "munged" or not alive(pid):
        return
    if slurm_daemons_elsewhere(directory):
        say(f"leaving munged (pid {pid}) running: other slurm daemons use it")
        return
    terminate([pid])
