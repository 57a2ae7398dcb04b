"""A private SLURM cluster on loopback: one slurmctld and N slurmd daemons on this machine, and
with ``--accounting`` a slurmdbd backed by a private MariaDB server.

Everything the cluster owns lives under one directory (its slurm.conf, slurmdbd.conf, state,
spool, database, logs, pid files and ``cluster.json``), so a test cluster and a user's demo
cluster can run side by side on different ports. Daemons are started with a marker in their
environment; the marker (inherited by the slurmstepd processes they fork) and the pid files
checked against the processes' command lines are how ``down`` finds exactly the processes this
cluster started and nothing else.

``up`` on a cluster whose daemons partly died restarts only the dead ones: slurmctld recovers its
queue from the state directory and a restarted slurmd brings its node back, so queued work is never
lost. A change that would need a new cluster (another shape, accounting switched) is refused, with
the jobs it would destroy named; ``down`` is the one command that wipes a cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import psutil

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
from orchestrator.slurm.commands import run_slurm

DEFAULT_NODES = 2
URGENT_PARTITION = "urgent"  # with --preemption: its jobs preempt those of the default one
PREEMPT_GRACE_S = 20  # a preempted job's time to save between SIGTERM and SIGKILL
REQUEUE_HOLD_S = 11  # how long SLURM holds a requeued job before it may start again
DEFAULT_CPUS_PER_NODE = 1
RECORD_NAME = "cluster.json"
CONF_NAME = "slurm.conf"
DBD_CONF_NAME = "slurmdbd.conf"
MARKER_ENV = "ORCH_LOOPBACK_CLUSTER"
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "munged")
ACCOUNTING_BINARIES = ("slurmdbd", "sacct", "sacctmgr", "mariadbd", "mariadb-install-db")
SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")
MUNGE_RUN_DIR = Path("/run/munge")
MUNGE_PID_FILE = MUNGE_RUN_DIR / "munged.pid"
SLURM_USER = "root"  # runs every daemon (slurmd and munged need root here anyway)
UP_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 10.0
# Node states that will not turn idle by themselves (a config the node cannot meet).
STUCK_STATES = ("inval", "drained", "draining", "fail", "failing")
# Node states (sinfo %T) of a node that takes or runs jobs.
SERVING_STATES = ("idle", "mixed", "allocated", "completing")
PID_FILE_GRACE_S = 5.0  # a daemon with no pid file by then has died
COMMAND_TIMEOUT_S = 30.0
# slurmd puts unix sockets named <node>_<job>.<step> in its spool dir; their paths must fit in
# sun_path (108 bytes), which bounds how deep the cluster directory may be.
SOCKET_NAME_ROOM = 32
SUN_PATH_MAX = 107
STATE_ENTRIES = (CONF_NAME, DBD_CONF_NAME, RECORD_NAME, "state", "spool", "pid", "db")
# The private MariaDB server: no TCP at all, slurmdbd reaches it through this socket (given to
# its client library as MYSQL_UNIX_PORT) as root, authenticated by the socket's peer uid, so no
# password exists anywhere.
DB_NAME = "slurm_acct_db"
DB_SOCKET = "db/mariadb.sock"
DB_DATA = "db/data"


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
    accounting: bool = False  # slurmdbd + MariaDB (records of earlier versions have none)
    dbd_port: int | None = None
    preemption: bool = False  # partitions debug (preemptible) and urgent (preempts it)

    def shape(self) -> str:
        return (
            f"{len(self.nodes)} nodes x {self.cpus_per_node} CPUs, "
            f"accounting {'on' if self.accounting else 'off'}, "
            f"preemption {'on' if self.preemption else 'off'}"
        )


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


def require_binaries(accounting: bool = False) -> dict[str, str]:
    """Full paths of the SLURM, munge (and accounting) programs; one clear error when any is
    missing."""
    search_path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN_DIRS])
    names = BINARIES + (ACCOUNTING_BINARIES if accounting else ())
    found = {name: shutil.which(name, path=search_path) for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise UsageError(
            f"SLURM is not installed here (missing: {', '.join(missing)}); run `make setup-slurm` "
            "(apt-installs slurmctld slurmd slurm-client munge slurmdbd mariadb-server)"
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
    """slurm.conf for the cluster: absolute paths only (the daemons change directory).

    The timeouts suit daemons that all run on one machine and answer in milliseconds: a dead
    slurmd is noticed within seconds (SLURM's defaults wait minutes, sized for real networks).
    """
    directory = Path(info.directory)
    if info.accounting:
        accounting = [
            "# Jobs are recorded by this cluster's slurmdbd (sacct reads them); the linux gatherer",
            "# adds memory and CPU use per step, cheap at its default 30 s period.",
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={info.dbd_port}",
            "JobAcctGatherType=jobacct_gather/linux",
        ]
    else:
        accounting = [
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
        ]
    lines = [
        "# Written by `orchestrator cluster up`; removed by `orchestrator cluster down`.",
        "ClusterName=loopback",
        f"SlurmctldHost={info.hostname}(127.0.0.1)",
        f"SlurmctldPort={info.controller_port}",
        f"SlurmUser={SLURM_USER}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",
        *accounting,
        "JobCompType=jobcomp/none",
        "MailProg=/bin/true",
        "SchedulerParameters=sched_interval=2,bf_interval=1",
        "# A slurmd silent for 5 s is marked DOWN (pings come every SlurmdTimeout/3, so a dead",
        "# one is DOWN within about 15 s, not the default 300 s): its jobs end instead of",
        "# hanging in COMPLETING, and jobs waiting for nodes are not held by a dead one.",
        "SlurmdTimeout=5",
        "# Only a backup controller would act on it; kept short and explicit for the same reason.",
        "SlurmctldTimeout=5",
        "# Round trips on loopback take milliseconds; 5 s still leaves room for a busy machine",
        "# and bounds how long a command waits on a dead controller.",
        "MessageTimeout=5",
        "# A DOWN node that registers again with a valid config (its slurmd restarted) returns to",
        "# service by itself, whatever made it DOWN.",
        "ReturnToService=2",
        "# A job whose node failed ends NODE_FAIL rather than being requeued: chains go on by",
        "# dependency, not requeue, and on loopback a 'failed' node's job may still be running",
        "# (only its slurmd died), so a requeued copy would run beside it. A job submitted with",
        "# --requeue (a recipe's `requeue: true`) is still requeued when it is preempted.",
        "JobRequeue=0",
        "KillWait=2",
        "MinJobAge=300",
        f"FirstJobId={first_job_id(info.controller_port)}",
        "InactiveLimit=0",
        "Waittime=0",
        "# The queue survives a restart of slurmctld (never started with -c) through this dir.",
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
    nodes = ",".join(info.nodes)
    debug = f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP"
    if not info.preemption:
        return "\n".join([*lines, debug]) + "\n"
    lines += [
        "# A job of the urgent partition preempts jobs of debug that hold the nodes it needs:",
        f"# they get SIGTERM, then SIGKILL {PREEMPT_GRACE_S} s later, and are requeued (same id)",
        "# where submitted with --requeue, else end PREEMPTED.",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        "# A requeued job waits cred_expire + 1 s before it may start again (default 120 s).",
        f"AuthInfo=cred_expire={REQUEUE_HOLD_S - 1}",
        f"{debug} PriorityTier=1 PreemptMode=REQUEUE GraceTime={PREEMPT_GRACE_S}",
        f"PartitionName={URGENT_PARTITION} Nodes={nodes} MaxTime=INFINITE State=UP "
        "PriorityTier=10 PreemptMode=OFF",
    ]
    return "\n".join(lines) + "\n"


def render_dbd_conf(info: ClusterInfo) -> str:
    """slurmdbd.conf: slurmdbd on loopback, storing into the private MariaDB through its socket.

    It holds no password (the database trusts root on its socket), but slurmdbd insists on a
    file only its user can read, as it would hold one on a real cluster.
    """
    directory = Path(info.directory)
    return (
        "\n".join(
            [
                "# Written by `orchestrator cluster up --accounting`; removed by `cluster down`.",
                "AuthType=auth/munge",
                f"DbdHost={info.hostname}",
                "DbdAddr=127.0.0.1",
                f"DbdPort={info.dbd_port}",
                f"SlurmUser={SLURM_USER}",
                f"PidFile={_pid_file(directory, 'slurmdbd')}",
                f"LogFile={_log_file(directory, 'slurmdbd')}",
                "StorageType=accounting_storage/mysql",
                "# localhost: the client library goes through MYSQL_UNIX_PORT, the private socket",
                "StorageHost=localhost",
                f"StorageUser={SLURM_USER}",
                f"StorageLoc={DB_NAME}",
            ]
        )
        + "\n"
    )


def write_confs(info: ClusterInfo) -> None:
    """slurm.conf, and slurmdbd.conf (mode 600, owned by the SlurmUser) with accounting."""
    Path(info.conf).write_text(render_conf(info))
    if not info.accounting:
        return
    dbd_conf = Path(info.directory) / DBD_CONF_NAME
    dbd_conf.unlink(missing_ok=True)
    fd = os.open(dbd_conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(render_dbd_conf(info))
    shutil.chown(dbd_conf, user=SLURM_USER, group=SLURM_USER)


# ---- processes ----


def _daemons(info: ClusterInfo) -> list[str]:
    """The cluster's daemons in the order they start: storage first, nodes last."""
    storage = ["mariadbd", "slurmdbd"] if info.accounting else []
    return [*storage, "slurmctld", *(f"slurmd-{node}" for node in info.nodes)]


def _pid_from_file(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _is_our_daemon(pid: int, daemon: str, directory: Path) -> bool:
    """The pid is that daemon of this cluster (not a reused pid): its program, and this
    cluster's dir in its command line (conf, datadir) or its environment (the marker)."""
    argv = command_line(pid)
    if not argv or Path(argv[0]).name != daemon.split("-", 1)[0] or not alive(pid):
        return False
    marker = str(directory)
    if any(marker in arg for arg in argv):
        return True
    try:
        return environment(psutil.Process(pid)).get(MARKER_ENV) == marker
    except psutil.Error:
        return False


def daemon_pids(directory: Path | str) -> dict[str, int | None]:
    """Each daemon's pid from its pid file, or None when the file is missing or the pid is not
    (any longer) that daemon."""
    path = _dir(directory)
    info = load(path)
    if info is None:
        return {}
    pids: dict[str, int | None] = {}
    for daemon in _daemons(info):
        pid = _pid_from_file(_pid_file(path, daemon))
        pids[daemon] = pid if pid is not None and _is_our_daemon(pid, daemon, path) else None
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
        process.name() in ("slurmctld", "slurmd", "slurmstepd", "slurmdbd")
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


def queue_summary(conf: Path | str) -> str:
    """The queue in a few words (``12 RUNNING, 13 PENDING``), or why it could not be read."""
    try:
        output = _query(["squeue", "--noheader", "--format=%i %T"], str(conf), retry=False)
    except SchedulerError as error:
        return f"unknown: {error}"
    jobs = [line.strip() for line in output.splitlines() if line.strip()]
    return ", ".join(jobs) if jobs else "empty"


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


def _daemon_env(info: ClusterInfo) -> dict[str, str]:
    """What every daemon of the cluster is started with: its conf, its marker, its database."""
    return {
        **os.environ,
        "SLURM_CONF": info.conf,
        MARKER_ENV: info.directory,
        "MYSQL_UNIX_PORT": str(Path(info.directory) / DB_SOCKET),
    }


def _run_start(argv: list[str], info: ClusterInfo, daemon: str) -> None:
    """Run a self-daemonizing program to its end; its own output is appended to
    log/<daemon>.out."""
    directory = Path(info.directory)
    with (directory / "log" / f"{daemon}.out").open("a") as out:
        completed = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_daemon_env(info),
            timeout=COMMAND_TIMEOUT_S,
            start_new_session=True,
        )
    if completed.returncode != 0:
        raise SchedulerError(
            f"{daemon} exited with {completed.returncode} at start:\n{_log_tails(directory)}"
        )


def _wait_for(ready: Callable[[], bool], what: str, daemon: str, info: ClusterInfo) -> None:
    """Poll ``ready()`` until it holds; fail with the logs once the daemon died or time is up."""
    directory = Path(info.directory)
    started = time.monotonic()
    while not ready():
        elapsed = time.monotonic() - started
        dead = daemon_pids(directory).get(daemon) is None and elapsed > PID_FILE_GRACE_S
        if dead or elapsed > UP_TIMEOUT_S:
            why = f"{daemon} is not running" if dead else f"still waiting after {elapsed:.0f} s"
            raise SchedulerError(f"{what} ({why}); the logs end:\n{_log_tails(directory)}")
        time.sleep(0.2)


def _accepts(family: int, address: str | tuple[str, int]) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(address)
        except OSError:
            return False
    return True


def _db_options(directory: Path) -> list[str]:
    """mariadbd's settings, shared by the one-off initialisation: no TCP, a small footprint."""
    return [
        f"--datadir={directory / DB_DATA}",
        f"--socket={directory / DB_SOCKET}",
        f"--user={SLURM_USER}",
        "--skip-networking",
        "--skip-log-bin",
        "--skip-name-resolve",
        "--performance-schema=OFF",
        "--innodb-buffer-pool-size=32M",
        "--innodb-log-file-size=16M",
        "--innodb-lock-wait-timeout=900",  # what slurmdbd asks for
        # Commits reach the OS at once (a killed server loses nothing) and the disk once a
        # second: only a crash of the machine could lose the last second of a test bed.
        "--innodb-flush-log-at-trx-commit=2",
    ]


def _start_mariadbd(info: ClusterInfo, binaries: dict[str, str]) -> None:
    """Initialise the datadir once (``mariadb-install-db``), then run mariadbd, which does not
    daemonize itself, in a session of its own; return when its socket answers."""
    directory = Path(info.directory)
    if not (directory / DB_DATA / "mysql").is_dir():
        _run_start(
            [
                binaries["mariadb-install-db"],
                "--no-defaults",  # never /etc/mysql: this server is the cluster's own
                *_db_options(directory),
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ],
            info,
            "mariadb-install-db",
        )
    with (directory / "log" / "mariadbd.out").open("a") as out:
        subprocess.Popen(
            [
                binaries["mariadbd"],
                "--no-defaults",
                *_db_options(directory),
                f"--pid-file={_pid_file(directory, 'mariadbd')}",
                f"--log-error={_log_file(directory, 'mariadbd')}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_daemon_env(info),
            start_new_session=True,
        )
    socket_path = str(directory / DB_SOCKET)
    _wait_for(
        partial(_accepts, socket.AF_UNIX, socket_path), "mariadbd did not answer", "mariadbd", info
    )


def _start(info: ClusterInfo, daemon: str, binaries: dict[str, str]) -> None:
    """Start one daemon of the cluster; the storage daemons are waited for, as slurmctld
    registers with slurmdbd when it starts."""
    if daemon == "mariadbd":
        _start_mariadbd(info, binaries)
    elif daemon == "slurmdbd":
        _run_start([binaries["slurmdbd"]], info, daemon)
        address = ("127.0.0.1", int(info.dbd_port or 0))
        _wait_for(
            partial(_accepts, socket.AF_INET, address), "slurmdbd did not answer", daemon, info
        )
    elif daemon == "slurmctld":
        _run_start([binaries["slurmctld"], "-f", info.conf], info, daemon)
    else:
        node = daemon.removeprefix("slurmd-")
        _run_start([binaries["slurmd"], "-f", info.conf, "-N", node], info, daemon)


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
                _query(["scontrol", "update", f"nodename={node}", "state=resume"], info.conf)
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
                f"{_log_tails(directory)}"
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


def is_running(directory: Path | str) -> bool:
    """Every daemon of the recorded cluster is alive."""
    pids = daemon_pids(directory)
    return bool(pids) and all(pid is not None for pid in pids.values())


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
    path = _dir(directory)
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
        for daemon in _daemons(info):
            _start(info, daemon, binaries)
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
    if not _munged_pids():
        info.started_munged, info.munged_pid = ensure_munged(binaries["munged"])
        atomic_write_json(path / RECORD_NAME, asdict(info))
        say(f"munged was not running: started it (pid {info.munged_pid})")
    pids = daemon_pids(path)
    dead = [daemon for daemon in _daemons(info) if pids.get(daemon) is None]
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
        _start(info, daemon, binaries)
    restarted = [daemon.removeprefix("slurmd-") for daemon in dead if daemon.startswith("slurmd-")]
    _wait_until_serving(info, timeout_s, restarted)
    say(f"queue: {queue_summary(info.conf)}")
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
    for daemon in _daemons(info):
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
