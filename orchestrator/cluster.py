"""A private SLURM cluster on loopback: one slurmctld and N slurmd daemons on this machine.

Everything the cluster owns lives under one directory (its slurm.conf, state, spool, logs, pid
files and ``cluster.json``), so a test cluster and a user's demo cluster can run side by side on
different ports. Daemons are started with a marker in their environment; the marker (inherited by
the slurmstepd processes they fork) and the pid files checked against the processes' command
lines are how ``down`` finds exactly the processes this cluster started and nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.errors import SchedulerError, UsageError
from orchestrator.manifest import atomic_write_json, orch_home
from orchestrator.processes import (
    alive,
    command_line,
    environment,
    live_processes,
    process_name,
    terminate,
    with_descendants,
)
from orchestrator.retry import ATTEMPTS, is_transient
from orchestrator.slurm_commands import run_slurm

DEFAULT_NODES = 2
DEFAULT_CPUS_PER_NODE = 1
RECORD_NAME = "cluster.json"
CONF_NAME = "slurm.conf"
MARKER_ENV = "ORCH_LOOPBACK_CLUSTER"
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "munged")
SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")
MUNGE_RUN_DIR = Path("/run/munge")
MUNGE_PID_FILE = MUNGE_RUN_DIR / "munged.pid"
UP_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 10.0
# Node states that will not turn idle by themselves (a config the node cannot meet).
STUCK_STATES = ("inval", "drained", "draining", "fail", "failing")
PID_FILE_GRACE_S = 5.0  # a daemon with no pid file by then has died
COMMAND_TIMEOUT_S = 30.0
# slurmd puts unix sockets named <node>_<job>.<step> in its spool dir; their paths must fit in
# sun_path (108 bytes), which bounds how deep the cluster directory may be.
SOCKET_NAME_ROOM = 32
SUN_PATH_MAX = 107
STATE_ENTRIES = (CONF_NAME, RECORD_NAME, "state", "spool", "pid")


@dataclass
class ClusterInfo:
    """What ``up`` decided and ``down``/``status`` need: written to ``cluster.json``."""

    directory: str
    conf: str
    hostname: str
    nodes: list[str]
    cpus_per_node: int
    controller_port: int
    node_ports: dict[str, int]
    started_munged: bool
    munged_pid: int | None


def say(line: str) -> None:
    """Progress for people goes to stderr, so stdout stays clean for `eval $(... env)`."""
    print(line, file=sys.stderr, flush=True)


def default_dir() -> Path:
    return orch_home() / "cluster"


def _dir(directory: Path | str) -> Path:
    return Path(directory).expanduser().resolve()


def _pid_file(directory: Path, daemon: str) -> Path:
    return directory / "pid" / f"{daemon}.pid"


def _log_file(directory: Path, daemon: str) -> Path:
    return directory / "log" / f"{daemon}.log"


def load(directory: Path | str) -> ClusterInfo | None:
    """The cluster recorded in ``directory``, or None when there is none."""
    record = _dir(directory) / RECORD_NAME
    if not record.is_file():
        return None
    return ClusterInfo(**json.loads(record.read_text()))


def require_binaries() -> dict[str, str]:
    """Full paths of the SLURM and munge programs; one clear error when any is missing."""
    search_path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN_DIRS])
    found = {name: shutil.which(name, path=search_path) for name in BINARIES}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise UsageError(
            f"SLURM is not installed here (missing: {', '.join(missing)}); "
            "run `make setup-slurm` (apt-installs slurmctld slurmd slurm-client munge)"
        )
    return {name: str(path) for name, path in found.items()}


def free_ports(count: int) -> list[int]:
    """Ports nobody listens on now: bind port 0 on loopback, all at once so they differ."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def first_job_id(controller_port: int) -> int:
    """Where this cluster's job ids start, spread by its (unique) controller port.

    Templates derive rendezvous ports from job ids, unique on a real cluster; two loopback
    clusters on one machine numbering jobs from 1 would hand their first jobs the same port.
    """
    return 1 + (controller_port * 7919) % 19_000


def render_conf(info: ClusterInfo) -> str:
    """slurm.conf for the cluster: absolute paths only (the daemons change directory)."""
    directory = Path(info.directory)
    lines = [
        "# Written by `orchestrator cluster up`; removed by `orchestrator cluster down`.",
        "ClusterName=loopback",
        f"SlurmctldHost={info.hostname}(127.0.0.1)",
        f"SlurmctldPort={info.controller_port}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "SchedulerParameters=sched_interval=2,bf_interval=1",
        "MessageTimeout=5",
        "KillWait=2",
        "MinJobAge=300",
        f"FirstJobId={first_job_id(info.controller_port)}",
        "InactiveLimit=0",
        "Waittime=0",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={directory / 'spool' / '%n'}",
        f"SlurmctldPidFile={_pid_file(directory, 'slurmctld')}",
        f"SlurmdPidFile={_pid_file(directory, 'slurmd-%n')}",
        f"SlurmctldLogFile={_log_file(directory, 'slurmctld')}",
        f"SlurmdLogFile={_log_file(directory, 'slurmd-%n')}",
    ]
    lines += [
        f"NodeName={node} NodeHostname={info.hostname} NodeAddr=127.0.0.1 "
        f"Port={info.node_ports[node]} CPUs={info.cpus_per_node} State=UNKNOWN"
        for node in info.nodes
    ]
    lines.append(
        f"PartitionName=debug Nodes={','.join(info.nodes)} Default=YES MaxTime=INFINITE State=UP"
    )
    return "\n".join(lines) + "\n"


# ---- processes ----


def _daemons(nodes: list[str]) -> list[str]:
    return ["slurmctld", *(f"slurmd-{node}" for node in nodes)]


def _pid_from_file(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _is_our_daemon(pid: int, daemon: str, conf: str) -> bool:
    """The pid is that daemon of this cluster (not a reused pid): checked by its cmdline."""
    argv = command_line(pid)
    program = daemon.split("-", 1)[0]
    return bool(argv) and Path(argv[0]).name == program and conf in argv and alive(pid)


def daemon_pids(directory: Path | str) -> dict[str, int | None]:
    """Each daemon's pid from its pid file, or None when the file is missing or the pid is not
    (any longer) that daemon."""
    path = _dir(directory)
    info = load(path)
    if info is None:
        return {}
    pids: dict[str, int | None] = {}
    for daemon in _daemons(info.nodes):
        pid = _pid_from_file(_pid_file(path, daemon))
        pids[daemon] = pid if pid is not None and _is_our_daemon(pid, daemon, info.conf) else None
    return pids


def marked_pids(directory: Path | str) -> list[int]:
    """Live processes started by this cluster's daemons (they carry its marker)."""
    marker = str(_dir(directory))
    return [
        process.pid
        for process in live_processes()
        if environment(process).get(MARKER_ENV) == marker
    ]


def running_clusters() -> dict[Path, dict[str, str]]:
    """Every loopback cluster with a live daemon on this machine: its dir and the environment
    its daemons were started with (which says who started them)."""
    found: dict[Path, dict[str, str]] = {}
    for process in live_processes():
        environ = environment(process)
        if MARKER_ENV in environ:
            found.setdefault(Path(environ[MARKER_ENV]), environ)
    return found


# ---- munge ----


def _munged_pids() -> list[int]:
    return [process.pid for process in live_processes() if process.name() == "munged"]


def ensure_munged(munged: str) -> tuple[bool, int | None]:
    """Start munged (as the munge user, like its systemd unit) unless one runs already.

    Returns whether this call started it, and its pid.
    """
    running = _munged_pids()
    if running:
        return False, running[0]
    MUNGE_RUN_DIR.mkdir(mode=0o755, exist_ok=True)
    shutil.chown(MUNGE_RUN_DIR, user="munge", group="munge")
    completed = subprocess.run(
        ["runuser", "-u", "munge", "--", munged],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    if completed.returncode != 0:
        running = _munged_pids()
        if running:  # another `up` started it at the same moment
            return False, running[0]
        raise SchedulerError(f"munged failed to start: {completed.stderr.strip()}")
    return True, _pid_from_file(MUNGE_PID_FILE)


def _slurm_daemons_elsewhere(directory: Path) -> bool:
    """Whether slurm daemons that are not this cluster's run on the machine (they need munge)."""
    marker = str(directory)
    return any(
        process.name() in ("slurmctld", "slurmd", "slurmstepd")
        and environment(process).get(MARKER_ENV) != marker
        for process in live_processes()
    )


# ---- queries ----


def _query(argv: list[str], conf: str, retry: bool = True) -> str:
    env = {**os.environ, "SLURM_CONF": conf}
    return run_slurm(argv, timeout_s=COMMAND_TIMEOUT_S, attempts=ATTEMPTS if retry else 1, env=env)


def node_states(conf: Path | str, retry: bool = True) -> dict[str, str]:
    """Each node's state as sinfo reports it (idle, allocated, down*, ...)."""
    argv = ["sinfo", "--noheader", "--Node", "--format=%N %T"]
    output = _query(argv, str(conf), retry)
    return dict(line.split(None, 1) for line in output.splitlines() if line.strip())


def queue_job_ids(conf: Path | str) -> list[str]:
    """Ids of the jobs in the cluster's queue (pending, running or completing)."""
    return _query(["squeue", "--noheader", "--format=%i"], str(conf)).split()


def cancel_all_jobs(conf: Path | str, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """scancel everything in the queue and wait until the queue is empty."""
    job_ids = queue_job_ids(conf)
    if job_ids:
        _query(["scancel", *job_ids], str(conf))
    deadline = time.monotonic() + timeout_s
    while job_ids and time.monotonic() < deadline:
        time.sleep(0.5)
        job_ids = queue_job_ids(conf)
    if job_ids:
        raise SchedulerError(f"jobs {job_ids} still in the queue {timeout_s:.0f} s after scancel")


# ---- up / down ----


def _log_tails(directory: Path, lines: int = 15) -> str:
    parts = []
    for log in sorted((directory / "log").glob("*")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        if tail:
            parts.append(f"--- {log} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts)


def _start_daemon(argv: list[str], directory: Path, daemon: str) -> None:
    """Run a self-daemonizing SLURM daemon; its own output goes to log/<daemon>.out."""
    env = {**os.environ, "SLURM_CONF": argv[argv.index("-f") + 1], MARKER_ENV: str(directory)}
    out_path = directory / "log" / f"{daemon}.out"
    with out_path.open("w") as out:
        completed = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=COMMAND_TIMEOUT_S,
            start_new_session=True,
        )
    if completed.returncode != 0:
        raise SchedulerError(
            f"{daemon} exited with {completed.returncode} at start:\n{_log_tails(directory)}"
        )


def _wait_until_idle(info: ClusterInfo, timeout_s: float) -> None:
    """Poll sinfo until every node is idle; fail early when a daemon has died."""
    directory = Path(info.directory)
    started = time.monotonic()
    last_report = ""
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
        if all(states.get(node) == "idle" for node in info.nodes):
            say(f"nodes idle: {report}")
            return
        if report != last_report:
            say(f"  {report}")
            last_report = report
        stuck = [node for node in info.nodes if states.get(node) in STUCK_STATES]
        if elapsed > timeout_s or stuck or (dead and elapsed > PID_FILE_GRACE_S):
            why = f"daemons not running: {', '.join(dead)}" if dead else f"nodes: {report}"
            raise SchedulerError(
                f"the cluster in {directory} did not come up after {elapsed:.0f} s ({why}); "
                "its logs end:\n"
                f"{_log_tails(directory)}"
            )
        time.sleep(0.5)


def _check_dir_depth(directory: Path, nodes: list[str]) -> None:
    longest = max(len(str(directory / "spool" / node)) for node in nodes) + SOCKET_NAME_ROOM
    if longest > SUN_PATH_MAX:
        raise UsageError(
            f"cluster dir {directory} is too deep for slurmd's unix sockets "
            f"(paths must stay under {SUN_PATH_MAX} bytes); pick a shorter --dir"
        )


def is_running(directory: Path | str) -> bool:
    """Every daemon of the recorded cluster is alive."""
    pids = daemon_pids(directory)
    return bool(pids) and all(pid is not None for pid in pids.values())


def up(
    directory: Path | str,
    nodes: int | None = None,
    cpus_per_node: int | None = None,
    timeout_s: float = UP_TIMEOUT_S,
) -> ClusterInfo:
    """Start the cluster (or find it running) and return once every node is idle.

    ``nodes``/``cpus_per_node`` left None take the defaults for a new cluster and accept any
    shape of a running one; given, they must match a running one.
    """
    if (nodes is not None and nodes < 1) or (cpus_per_node is not None and cpus_per_node < 1):
        raise UsageError("--nodes and --cpus-per-node must be at least 1")
    binaries = require_binaries()
    if os.geteuid() != 0:
        raise UsageError("cluster up runs slurmd and munged, which need root; run it as root")
    path = _dir(directory)
    existing = load(path)
    if existing is not None and is_running(path):
        wanted = (nodes or len(existing.nodes), cpus_per_node or existing.cpus_per_node)
        if wanted != (len(existing.nodes), existing.cpus_per_node):
            raise UsageError(
                f"a cluster with {len(existing.nodes)} nodes x {existing.cpus_per_node} CPUs "
                f"already runs in {path}; run `orchestrator cluster down --dir {path}` first"
            )
        say(f"cluster already running in {path}")
        return existing
    if existing is not None or marked_pids(path):
        say(f"stale cluster in {path}: cleaning it up")
        down(path)
    nodes = nodes or DEFAULT_NODES
    cpus_per_node = cpus_per_node or DEFAULT_CPUS_PER_NODE
    node_names = [f"n{index}" for index in range(1, nodes + 1)]
    _check_dir_depth(path, node_names)
    started_munged, munged_pid = ensure_munged(binaries["munged"])
    ports = free_ports(nodes + 1)
    info = ClusterInfo(
        directory=str(path),
        conf=str(path / CONF_NAME),
        hostname=socket.gethostname(),
        nodes=node_names,
        cpus_per_node=cpus_per_node,
        controller_port=ports[0],
        node_ports=dict(zip(node_names, ports[1:], strict=True)),
        started_munged=started_munged,
        munged_pid=munged_pid,
    )
    for sub in ("state", "pid", "log", *(f"spool/{node}" for node in node_names)):
        (path / sub).mkdir(parents=True, exist_ok=True)
    for log in (path / "log").glob("*"):
        log.unlink()
    Path(info.conf).write_text(render_conf(info))
    atomic_write_json(path / RECORD_NAME, asdict(info))
    say(
        f"starting {nodes} nodes x {cpus_per_node} CPUs in {path} "
        f"(slurmctld on port {info.controller_port})"
    )
    try:
        _start_daemon([binaries["slurmctld"], "-f", info.conf], path, "slurmctld")
        for node in node_names:
            _start_daemon([binaries["slurmd"], "-f", info.conf, "-N", node], path, f"slurmd-{node}")
        _wait_until_idle(info, timeout_s)
    except BaseException:
        down(path)
        raise
    return info


def down(directory: Path | str) -> bool:
    """Stop what this cluster started and remove its state; False when nothing was there."""
    path = _dir(directory)
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
    if _slurm_daemons_elsewhere(directory):
        say(f"leaving munged (pid {pid}) running: other slurm daemons use it")
        return
    terminate([pid])


# ---- env / status ----


def _require(directory: Path | str) -> ClusterInfo:
    path = _dir(directory)
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
    lines = [f"cluster: {info.directory}", f"conf:    {info.conf}", "daemons:"]
    pids = daemon_pids(info.directory)
    for daemon in _daemons(info.nodes):
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


# ---- command line ----


def _cmd_up(args: argparse.Namespace) -> int:
    info = up(args.dir, args.nodes, args.cpus_per_node)
    say(f"cluster up: {len(info.nodes)} nodes; point SLURM at it with:")
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

    start = add("up", _cmd_up, "start the cluster and wait until every node is idle")
    start.add_argument("--nodes", type=int, help=f"node daemons to start (default {DEFAULT_NODES})")
    start.add_argument(
        "--cpus-per-node",
        type=int,
        help=f"CPUs each node offers, may exceed the real ones (default {DEFAULT_CPUS_PER_NODE})",
    )
    add("down", _cmd_down, "stop the daemons this cluster started and remove its state")
    add("env", _cmd_env, "print `export SLURM_CONF=...` for a shell")
    add("status", _cmd_status, "nodes, daemons and pids")
