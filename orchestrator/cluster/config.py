"""The cluster's config files: slurm.conf and, with accounting, slurmdbd.conf; the ports and
job ids they give it."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from orchestrator.cluster.record import DB_NAME, DBD_CONF_NAME, ClusterInfo, log_file, pid_file

URGENT_PARTITION = "urgent"  # with --preemption: its jobs preempt those of the default one
PREEMPT_GRACE_S = 20  # a preempted job's time to save between SIGTERM and SIGKILL
# From a job's SIGTERM (scancel, NODE_FAIL, the time limit) to SLURM's SIGKILL: the trainer's save
# and exit and the end hook must fit, on a loaded machine too (2 s and then 10 s did not, under
# a full test run; ~3 s unloaded). SLURM's default, 30 s: a job that exits on its SIGTERM ends
# sooner, so only one that outlives it waits this long.
KILL_WAIT_S = 30
REQUEUE_HOLD_S = 11  # how long SLURM holds a requeued job before it may start again
SLURM_USER = "root"  # runs every daemon (slurmd and munged need root here anyway)


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
        f"KillWait={KILL_WAIT_S}",
        "MinJobAge=300",
        f"FirstJobId={first_job_id(info.controller_port)}",
        "InactiveLimit=0",
        "Waittime=0",
        "# The queue survives a restart of slurmctld (never started with -c) through this dir.",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={directory / 'spool' / '%n'}",
        f"SlurmctldPidFile={pid_file(directory, 'slurmctld')}",
        f"SlurmdPidFile={pid_file(directory, 'slurmd-%n')}",
        f"SlurmctldLogFile={log_file(directory, 'slurmctld')}",
        f"SlurmdLogFile={log_file(directory, 'slurmd-%n')}",
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
                f"PidFile={pid_file(directory, 'slurmdbd')}",
                f"LogFile={log_file(directory, 'slurmdbd')}",
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
