"""The cluster's daemons: which live processes are its own, and starting each one.

Daemons are started with a marker in their environment; the marker (inherited by the
slurmstepd processes they fork) and the pid files checked against the processes' command lines
are how ``down`` finds exactly the processes this cluster started and nothing else.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psutil

from orchestrator.cluster.config import SLURM_USER
from orchestrator.cluster.record import (
    COMMAND_TIMEOUT_S,
    DB_DATA,
    DB_SOCKET,
    ClusterInfo,
    load,
    log_file,
    pid_file,
    resolve_dir,
)
from orchestrator.errors import SchedulerError, UsageError
from orchestrator.processes import alive, command_line, environment, live_processes

MARKER_ENV = "ORCH_LOOPBACK_CLUSTER"
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "munged")
ACCOUNTING_BINARIES = ("slurmdbd", "sacct", "sacctmgr", "mariadbd", "mariadb-install-db")
SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")
UP_TIMEOUT_S = 60.0
PID_FILE_GRACE_S = 5.0  # a daemon with no pid file by then has died


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


def daemon_names(info: ClusterInfo) -> list[str]:
    """The cluster's daemons in the order they start: storage first, nodes last."""
    storage = ["mariadbd", "slurmdbd"] if info.accounting else []
    return [*storage, "slurmctld", *(f"slurmd-{node}" for node in info.nodes)]


def pid_from_file(path: Path) -> int | None:
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
    path = resolve_dir(directory)
    info = load(path)
    if info is None:
        return {}
    pids: dict[str, int | None] = {}
    for daemon in daemon_names(info):
        pid = pid_from_file(pid_file(path, daemon))
        pids[daemon] = pid if pid is not None and _is_our_daemon(pid, daemon, path) else None
    return pids


def is_running(directory: Path | str) -> bool:
    """Every daemon of the recorded cluster is alive."""
    pids = daemon_pids(directory)
    return bool(pids) and all(pid is not None for pid in pids.values())


def marked_pids(directory: Path | str) -> list[int]:
    """Live processes started by this cluster's daemons (they carry its marker)."""
    marker = str(resolve_dir(directory))
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


def log_tails(directory: Path, lines: int = 15) -> str:
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
            f"{daemon} exited with {completed.returncode} at start:\n{log_tails(directory)}"
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
            raise SchedulerError(f"{what} ({why}); the logs end:\n{log_tails(directory)}")
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
                f"--pid-file={pid_file(directory, 'mariadbd')}",
                f"--log-error={log_file(directory, 'mariadbd')}",
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


def start_daemon(info: ClusterInfo, daemon: str, binaries: dict[str, str]) -> None:
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
