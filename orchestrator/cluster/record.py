"""What a loopback cluster records about itself (``cluster.json``), where it keeps everything
under its one directory, and the limits its modules share.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from orchestrator.manifest import orch_home

RECORD_NAME = "cluster.json"
CONF_NAME = "slurm.conf"
DBD_CONF_NAME = "slurmdbd.conf"
STATE_ENTRIES = (CONF_NAME, DBD_CONF_NAME, RECORD_NAME, "state", "spool", "pid", "db")
COMMAND_TIMEOUT_S = 30.0
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


def resolve_dir(directory: Path | str) -> Path:
    return Path(directory).expanduser().resolve()


def pid_file(directory: Path, daemon: str) -> Path:
    return directory / "pid" / f"{daemon}.pid"


def log_file(directory: Path, daemon: str) -> Path:
    return directory / "log" / f"{daemon}.log"


def load(directory: Path | str) -> ClusterInfo | None:
    """The cluster recorded in ``directory``, or None when there is none."""
    record = resolve_dir(directory) / RECORD_NAME
    if not record.is_file():
        return None
    return ClusterInfo(**json.loads(record.read_text()))
