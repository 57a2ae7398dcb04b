"""A process that imports torch and the trainer once, then forks the ranks of each command
the tests run (``python -m MODULE ARGS`` or ``python SCRIPT ARGS`` on N ranks), so that no rank
pays the import again.

A rank's start-up is ~7 CPU-seconds of imports (torch, DTensor, DCP, dynamo, lhotse), and
torchrun's own process another ~3: on the suite's two cores that was a large share of every
test that runs the trainer. The zygote holds no thread and runs no tensor op before it forks
(a fork of a process with threads, OpenMP's included, may deadlock), so each rank begins from
the state a fresh interpreter reaches after those imports, then runs as ``python -m MODULE`` or
``python SCRIPT`` does: as ``__main__``, with its own argv, sys.path, environment and working
directory, stdout and stderr into the caller's files, and the interpreter's exit (threads
joined, atexit hooks run).

The ranks rendezvous as torchrun's do, through the environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``: rank 0 hosts the store), each in a session of its own;
when one rank fails the others get SIGTERM and, 30 s later, SIGKILL, as under torchrun.

Protocol: one JSON request per line on stdin (``argv``: Python's arguments after the
interpreter; ``nproc``, ``env``, ``cwd``, ``stdout``, ``stderr``); the zygote answers with a
line ``{"pids": [...]}`` as the ranks start and a line ``{"codes": [...], "first": RANK}`` when
they have all exited (``first`` is the rank that failed first, or null).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from functools import partial

from orchestrator.cluster.config import free_ports

# What the commands run through the zygote import: loaded here once, before any fork.
PRELOADED = (
    "torch",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "hydra",
    "lhotse",
    "transformers",
    "train.trainer",
    "train.evaluate",
    "train.export",
    "tests.harness.workers.trainer_runs_worker",
)
KILL_AFTER_TERM_S = 30  # torchrun's wait between a failed rank's peers' SIGTERM and SIGKILL


def run_rank(request: dict, rank: int, port: int) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` as rank ``rank``; never returns."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["nproc"] > 1:
        world = str(request["nproc"])
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=world,
            LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    argv = request["argv"]
    if argv[0] == "-m":  # ``python -m MODULE``: the working directory first on sys.path
        module = argv[1]
        sys.argv = [module, *argv[2:]]
        first_path = request["cwd"]
        sys.modules.pop(module, None)  # run fresh as __main__, as ``python -m`` would
        run = partial(runpy.run_module, module, run_name="__main__", alter_sys=True)
    else:  # ``python SCRIPT``: the script's folder first
        sys.argv = list(argv)
        first_path = os.path.dirname(os.path.abspath(argv[0]))
        run = partial(runpy.run_path, argv[0], run_name="__main__")
    if os.path.realpath(first_path) != os.path.realpath(sys.path[0]):
        sys.path.insert(0, first_path)
    code = 0
    try:
        run()
    except SystemExit as stop:
        code = exit_code(stop)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own exit order
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def run(request: dict) -> None:
    port = free_ports(1)[0]
    pids = []
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            run_rank(request, rank, port)
        pids.append(pid)
    answer({"pids": pids})
    codes: dict[int, int] = {}
    first = None
    term_at = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if term_at is not None and time.monotonic() - term_at > KILL_AFTER_TERM_S:
                signal_all(pids, codes, signal.SIGKILL)
            time.sleep(0.05)
            continue
        rank = pids.index(pid)
        codes[rank] = os.waitstatus_to_exitcode(status)
        if codes[rank] != 0 and first is None:
            first = rank
            signal_all(pids, codes, signal.SIGTERM)
            term_at = time.monotonic()
    answer({"codes": [codes[rank] for rank in range(len(pids))], "first": first})


def signal_all(pids: list[int], exited: dict[int, int], signum: int) -> None:
    for rank, pid in enumerate(pids):
        if rank not in exited:
            try:
                os.killpg(pid, signum)  # the rank and what it started (its own session)
            except ProcessLookupError:
                os.kill(pid, signum)  # not yet in a session of its own


def answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    # No collection while the modules import; the heap they made frozen before any fork, so a
    # rank's collections never walk (nor copy the pages of) what it inherited (gc.freeze's advice).
    gc.disable()
    for name in PRELOADED:
        __import__(name)
    gc.freeze()
    gc.enable()
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1
    answer({"ready": True})
    for line in sys.stdin:
        run(json.loads(line))


if __name__ == "__main__":
    main()
