"""Processes on this machine, through psutil: liveness, command lines, trees, term-then-kill.

One place for what the loopback cluster, the local backend and submitit's local half need to know
about processes; a process that ends while it is being read simply drops out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

from orchestrator.errors import SchedulerError

STOP_TIMEOUT_S = 5.0


def alive(pid: int) -> bool:
    """Running and not a zombie waiting to be reaped."""
    try:
        return _running(psutil.Process(pid))
    except psutil.Error:
        return False


def command_line(pid: int) -> list[str]:
    """The process's argv; empty when it is gone or not readable."""
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def live_processes() -> Iterator[psutil.Process]:
    """Every readable, non-zombie process but this one."""
    own = os.getpid()
    for process in psutil.process_iter():
        if process.pid != own and _running(process):
            yield process


def environment(process: psutil.Process) -> dict[str, str]:
    """The environment a process started with; empty when it is not readable.

    Read from /proc rather than with ``psutil.Process.environ``, which stops at the first empty
    entry: slurmstepd writes its process title over the start of that block, and the cluster
    marker after it would be lost.
    """
    try:
        raw = Path(f"/proc/{process.pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (part.decode(errors="replace").partition("=") for part in raw.split(b"\0") if part)
    return {key: value for key, _, value in pairs}


def with_descendants(pids: Iterable[int]) -> list[int]:
    """The live processes and everything they forked that still hangs below them."""
    found: set[int] = set()
    for pid in pids:
        try:
            process = psutil.Process(pid)
            found.update(child.pid for child in process.children(recursive=True))
        except psutil.Error:
            continue
        found.add(pid)
    return sorted(pid for pid in found if alive(pid))


def group_and_descendants(leader: int) -> list[int]:
    """A session leader's process group and its descendants: what a job started, orphans too."""
    members = []
    for process in live_processes():
        try:
            if os.getpgid(process.pid) == leader:
                members.append(process.pid)
        except OSError:
            continue
    return with_descendants([leader, *members])


def terminate(pids: Iterable[int], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL whatever is left; raise if any survives."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.Error:
            continue
    for stop in (psutil.Process.terminate, psutil.Process.kill):
        for process in processes:
            try:
                stop(process)
            except psutil.Error:
                continue
        processes = _wait_gone(processes, timeout_s)
        if not processes:
            return
    raise SchedulerError(f"processes {[process.pid for process in processes]} survived SIGKILL")


def _running(process: psutil.Process) -> bool:
    """Still this process (not a reused pid) and not a zombie.

    psutil.wait_procs would wait the whole timeout for a zombie that nobody reaps (a container
    whose init does not), though a zombie has already stopped.
    """
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    remaining = [process for process in processes if _running(process)]
    while remaining and time.monotonic() < deadline:
        time.sleep(0.1)
        remaining = [process for process in remaining if _running(process)]
    return remaining
