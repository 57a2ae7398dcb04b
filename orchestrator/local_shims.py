"""Single-node stand-ins for ``srun`` and ``scontrol``, put first on PATH by the local backend.

They let a recipe written for SLURM run unchanged on a machine without it: ``srun`` starts the
step's tasks with the SLURM_* variables a task reads and forwards signals to them; ``scontrol``
answers the two questions batch scripts ask (``show hostnames``, ``show node``).
Run as ``python -m orchestrator.local_shims srun|scontrol ARGS``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

# srun options that take a value (long and short forms); all others are flags.
SRUN_VALUE_OPTIONS = {
    "-n",
    "--ntasks",
    "-N",
    "--nodes",
    "--ntasks-per-node",
    "-c",
    "--cpus-per-task",
    "--gpus",
    "--gpus-per-node",
    "--gpus-per-task",
    "--gres",
    "-J",
    "--job-name",
    "-o",
    "--output",
    "-e",
    "--error",
    "--container-image",
    "--container-mounts",
    "--container-workdir",
    "--export",
    "--mpi",
    "-w",
    "--nodelist",
    "--cpu-bind",
    "--mem",
    "-t",
    "--time",
    "-D",
    "--chdir",
    "--kill-on-bad-exit",
    "-K",
    "--label",
}
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def parse_srun(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Split ``srun`` arguments into options and the command."""
    options: dict[str, str] = {}
    position = 0
    while position < len(argv) and argv[position].startswith("-"):
        word = argv[position]
        position += 1
        name, has_value, value = word.partition("=")
        if not has_value and name in SRUN_VALUE_OPTIONS and name not in ("--label",):
            if name in ("--kill-on-bad-exit", "-K"):
                value = "1"
            else:
                value = argv[position] if position < len(argv) else ""
                position += 1
        options[name.lstrip("-")] = value
    return options, argv[position:]


def task_count(options: dict[str, str], env: dict[str, str]) -> int:
    nodes = int(options.get("nodes") or options.get("N") or 1)
    if nodes != 1:
        raise SystemExit(
            f"srun (local backend): {nodes} nodes asked; this backend emulates one node"
        )
    if "ntasks" in options or "n" in options:
        return int(options.get("ntasks") or options["n"])
    if "ntasks-per-node" in options:
        return int(options["ntasks-per-node"])
    return int(env.get("SLURM_NTASKS", "1"))


def srun(argv: list[str]) -> int:
    options, command = parse_srun(argv)
    if not command:
        print("srun (local backend): no command given", file=sys.stderr)
        return 2
    ntasks = task_count(options, dict(os.environ))
    step = int(os.environ.get("ORCH_LOCAL_STEP", "0"))
    os.environ["ORCH_LOCAL_STEP"] = str(step + 1)
    children: list[subprocess.Popen[bytes]] = []
    for task in range(ntasks):
        env = dict(os.environ)
        env.update(
            SLURM_PROCID=str(task),
            SLURM_LOCALID=str(task),
            SLURM_NODEID="0",
            SLURM_STEPID=str(step),
            SLURM_STEP_NUM_TASKS=str(ntasks),
            SLURM_NTASKS=str(ntasks),
            SLURM_STEP_NUM_NODES="1",
        )
        children.append(subprocess.Popen(command, env=env))

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    codes = [child.wait() for child in children]
    return next((code for code in codes if code != 0), 0)


def scontrol(argv: list[str]) -> int:
    words = [word for word in argv if not word.startswith("-")]
    if words[:2] == ["show", "hostnames"]:
        nodelist = words[2] if len(words) > 2 else os.environ.get("SLURM_JOB_NODELIST", "localhost")
        for name in nodelist.split(","):
            print(name)
        return 0
    if words[:2] == ["show", "node"]:
        name = words[2] if len(words) > 2 else "localhost"
        host = socket.gethostname()
        print(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostName={host} State=ALLOCATED")
        return 0
    print(f"scontrol (local backend): 'scontrol {' '.join(argv)}' is not emulated", file=sys.stderr)
    return 1


def main() -> int:
    tool, *argv = sys.argv[1:]
    if tool == "srun":
        return srun(argv)
    if tool == "scontrol":
        return scontrol(argv)
    print(f"unknown shim {tool!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
