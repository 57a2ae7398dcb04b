"""Launching from a laptop: the toolkit's commands run on a cluster's login node over SSH.

``auto_launch --host [user@]HOST ...`` makes three ssh round trips, then reads the manifest:

1. check: ``orchestrator --version`` on the login node must print this toolkit's version (else
   one ``error:`` line saying how to install it or point ``--remote-bin`` at it); an unreachable
   host fails here, within ssh's ConnectTimeout, before anything is written anywhere;
2. send: the files a code snapshot copies (``orchestrator.snapshot.plan_code``: tracked files as
   on disk, untracked files git keeps) and a one-commit git history of ``HEAD``, as a tar stream
   into a fresh directory ``REMOTE_DIR/<tree>-<time>-<hex>`` (so that the login node sees the same
   commit, dirty flag and diff);
3. launch: ``auto_launch --json`` with the same arguments (less the ``--host`` options;
   ``--backend auto`` becomes ``slurm``) in that copy of the current directory: the login node
   freezes its own snapshot and submits with its own sbatch. A launch that queues nothing
   (bad input, a dry run) removes the copy.

The manifest stays on the login node. A copy of it (``$ORCH_HOME/remote/<host>/<chain>/``) and a
chain index entry that records the host let ``orchestrator list`` show the chain, and
``orchestrator status|logs|cancel`` run on that host (``--host`` for chains launched elsewhere);
``status`` refreshes the copy.

Only ``ssh`` runs here (``$ORCH_SSH``, default ``ssh``, in batch mode), so the user's ssh
configuration (keys, agent, ProxyJump, ControlMaster) applies and nothing secret is stored. Every
value put into a remote command is shell-quoted; the login shell there must be POSIX.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from orchestrator import __version__
from orchestrator.errors import SchedulerError, UsageError
from orchestrator.manifest import MANIFEST_NAME, atomic_write_json, index_path, orch_home
from orchestrator.snapshot import SNAPSHOT, CodeSource, plan_code

SSH_ENV = "ORCH_SSH"  # the ssh command line, e.g. "ssh -F ~/.ssh/cluster_config"
BIN_ENV = "ORCH_REMOTE_BIN"  # default of --remote-bin
DIR_ENV = "ORCH_REMOTE_DIR"  # default of --remote-dir
DEFAULT_DIR = "~/orch-launches"
CONNECT_TIMEOUT_S = 10  # an unreachable host fails within this (ssh's ConnectTimeout)
ANSWER_TIMEOUT_S = 60  # a short command (the check, reading a manifest) answers within this
SSH_FAILED = 255  # ssh's own exit status: no connection, no login, or the connection lost
NOT_FOUND = 127  # the remote shell found no such command
# What the one-commit history sent with the code keeps of a shallow fetch's .git (not the
# fetch's record of this machine's path, nor reflogs).
GIT_KEPT = ("HEAD", "config", "index", "objects", "refs", "shallow")
HOST_OPTIONS = ("--host", "--remote-bin")  # status, logs and cancel
LAUNCH_OPTIONS = (*HOST_OPTIONS, "--remote-dir")  # auto_launch


def ssh_command() -> list[str]:
    """The ssh command line: ``$ORCH_SSH`` split as a shell would, else plain ``ssh``."""
    given = os.environ.get(SSH_ENV, "").strip()
    return shlex.split(given) if given else ["ssh"]


def shell_path(path: str) -> str:
    """A path as one word of the remote shell: quoted, a leading ``~`` left to its $HOME."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def check_host(host: str) -> str:
    """``[user@]HOST`` as ssh takes it; never an option (``-oProxyCommand=...``)."""
    if not host or host.startswith("-") or any(ch.isspace() for ch in host):
        raise UsageError(f"--host {host!r}: give [user@]HOST, a name ssh knows or an address")
    return host


def strip_options(argv: Sequence[str], options: Sequence[str]) -> list[str]:
    """``argv`` without ``options`` (``--opt VALUE`` and ``--opt=VALUE``); nothing after ``--``
    is touched."""
    kept: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            kept.append(token)
            kept.extend(tokens)
            break
        name, has_value, _ = token.partition("=")
        if name in options:
            if not has_value:
                next(tokens, None)
            continue
        kept.append(token)
    return kept


def forwarded_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """The arguments to run on the host: ``argv`` without the host options. An abbreviated
    ``--host`` (argparse accepts ``--ho``) would reach the host and run there again: refused."""
    kept = strip_options(argv, LAUNCH_OPTIONS)
    if getattr(parser.parse_args(kept), "host", None) is not None:
        raise UsageError("write --host, --remote-dir and --remote-bin in full")
    return kept


def add_host_options(parser: argparse.ArgumentParser, launch: bool = False) -> None:
    """``--host`` and ``--remote-bin`` (and for ``auto_launch`` ``--remote-dir``)."""
    parser.add_argument(
        "--host",
        metavar="[USER@]HOST",
        help="run on this login node over ssh (your ssh configuration applies; "
        f"{SSH_ENV} replaces the ssh command)",
    )
    parser.add_argument(
        "--remote-bin",
        metavar="DIR",
        default=os.environ.get(BIN_ENV) or None,
        help="with --host: the bin directory of the environment the toolkit is installed in "
        f"on the host, put first on PATH there (default ${BIN_ENV}, else the login PATH)",
    )
    if launch:
        parser.add_argument(
            "--remote-dir",
            metavar="DIR",
            default=os.environ.get(DIR_ENV) or DEFAULT_DIR,
            help="with --host: where the code is copied on the host, one folder per launch "
            f"(default ${DIR_ENV}, else {DEFAULT_DIR})",
        )


def last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


@dataclass(frozen=True)
class Remote:
    """A login node, and where the toolkit is on it."""

    host: str
    bin_dir: str | None = None  # put first on PATH there (else the login shell's PATH)

    def script(self, body: str) -> str:
        """The remote shell's command line: ``body`` with the toolkit's bin directory on PATH."""
        if not self.bin_dir:
            return body
        return f'PATH={shell_path(self.bin_dir)}:"$PATH"; export PATH; {body}'

    def ssh_argv(self, body: str) -> list[str]:
        """The ssh command that runs ``body`` there: batch mode (no password prompts), a short
        ConnectTimeout; options in ``$ORCH_SSH`` come first, so they win."""
        return [
            *ssh_command(),
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
            "--", self.host, self.script(body),
        ]  # fmt: skip

    def run(
        self,
        body: str,
        *,
        stdin: IO[bytes] | None = None,
        capture_stdout: bool = True,
        capture_stderr: bool = True,
        timeout: float | None = ANSWER_TIMEOUT_S,
        doing: str = "",
    ) -> subprocess.CompletedProcess[str]:
        """Run ``body`` there. ssh's own failure (exit 255) is one UsageError naming ``doing``."""
        argv = self.ssh_argv(body)
        try:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL if stdin is None else stdin,
                stdout=subprocess.PIPE if capture_stdout else None,
                stderr=subprocess.PIPE if capture_stderr else None,
                text=True,
                timeout=timeout,
            )
        except FileNotFoundError as error:
            raise UsageError(
                f"--host: {argv[0]} not found ({error.strerror}): install OpenSSH's client, "
                f"or name your ssh command in {SSH_ENV}"
            ) from error
        except subprocess.TimeoutExpired as error:
            raise UsageError(f"--host {self.host}: no answer in {timeout:g} s{doing}") from error
        if done.returncode == SSH_FAILED:
            said = last_line(done.stderr) or "see ssh's message above"
            raise UsageError(f"--host {self.host}: ssh failed ({said}){doing}")
        return done

    def check_toolkit(self) -> None:
        """The host answers, and runs this version of the toolkit (else one clear line)."""
        nothing = ". Nothing was queued"
        done = self.run("orchestrator --version", doing=nothing)
        where = f"--remote-bin {self.bin_dir}" if self.bin_dir else "the login PATH"
        install = (
            f"install slurm-orchestrator {__version__} there (pip install "
            f"slurm-orchestrator=={__version__}) and give its environment's bin directory with "
            f"--remote-bin DIR or ${BIN_ENV}"
        )
        if done.returncode == NOT_FOUND:
            raise UsageError(
                f"--host {self.host}: the toolkit is not on {where} there "
                f"({last_line(done.stderr)}): {install}{nothing}"
            )
        said = last_line(done.stdout)
        name, _, version = said.rpartition(" ")
        if done.returncode != 0 or name != "orchestrator":
            raise UsageError(
                f"--host {self.host}: `orchestrator --version` failed there (exit "
                f"{done.returncode}: {last_line(done.stderr) or said}): {install}{nothing}"
            )
        if version != __version__:
            raise UsageError(
                f"--host {self.host}: the toolkit there ({where}) is version {version}, this "
                f"one {__version__}: {install}{nothing}"
            )

    def send_code(self, code: CodeSource | None, remote_dir: str, name: str) -> str:
        """Copy the code into the new directory ``remote_dir/name`` there; its absolute path."""
        target = f"{remote_dir.rstrip('/') or '/'}/{name}"
        quoted = shell_path(target)
        with tempfile.TemporaryFile() as archive:
            write_archive(archive, code)
            archive.seek(0)
            done = self.run(  # a copy that failed halfway is removed there and then
                f"mkdir -p {shell_path(remote_dir)} && mkdir {quoted} || exit 1; "
                f"if cd {quoted} && tar -xf - && pwd; then exit 0; fi; "
                f"cd / && rm -rf {quoted}; exit 1",
                stdin=archive,
                timeout=None,
                doing=". Nothing was queued",
            )
        if done.returncode != 0:
            raise UsageError(
                f"--host {self.host}: copying the code to {target} failed "
                f"({last_line(done.stderr)}). Nothing was queued"
            )
        return last_line(done.stdout)

    def read_file(self, path: str) -> str:
        done = self.run(f"cat {shlex.quote(path)}", doing=f" reading {path}")
        if done.returncode != 0:
            raise SchedulerError(f"{self.host}: cannot read {path}: {last_line(done.stderr)}")
        return done.stdout


def write_archive(archive: IO[bytes], code: CodeSource | None) -> None:
    """A tar of the snapshot's files and, for a tree with a commit, a one-commit git history
    (so that the host's own snapshot records the same commit, dirty flag and diff)."""
    with tarfile.open(fileobj=archive, mode="w") as tar:
        if code is None or code.tree is None:
            return
        try:
            for name in code.files:
                tar.add(code.tree / name, arcname=name, recursive=False, filter=anonymous)
            if code.commit:
                with tempfile.TemporaryDirectory(prefix="orch-history-") as scratch:
                    git_dir = one_commit_history(code.tree, code.commit, Path(scratch))
                    for entry in GIT_KEPT if git_dir else ():
                        if (git_dir / entry).exists():
                            tar.add(git_dir / entry, arcname=f".git/{entry}", filter=anonymous)
        except OSError as error:
            raise UsageError(f"--host: packing the code of {code.tree} failed: {error}") from error


def anonymous(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """No owner of this machine's: the files belong to whoever unpacks them there."""
    member.uid = member.gid = 0
    member.uname = member.gname = ""
    return member


def one_commit_history(tree: Path, commit: str, scratch: Path) -> Path | None:
    """A .git holding only ``commit`` (a shallow fetch of it) with an index of its tree; None,
    with a warning, where git cannot make one (the code then goes without its record)."""
    steps = [
        ["init", "-q", "--template=", str(scratch)],
        ["-C", str(scratch), "fetch", "-q", "--depth", "1", str(tree), commit],
        ["-C", str(scratch), "update-ref", "--no-deref", "HEAD", commit],
        ["-C", str(scratch), "read-tree", "HEAD"],
    ]
    for step in steps:
        done = subprocess.run(["git", *step], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            command = step[2] if step[0] == "-C" else step[0]
            print(
                f"warning: the code goes without its commit record (git {command} failed: "
                f"{last_line(done.stderr)}): the login node runs the copy and records no commit",
                file=sys.stderr,
            )
            return None
    return scratch / ".git"


# auto_launch --host ------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteLaunch:
    """What ``auto_launch --host`` did. ``summary`` is the host's ``auto_launch --json`` line
    (with ``host`` added) when a chain was queued, else None (a dry run, or nothing queued)."""

    exit_code: int
    summary: dict[str, Any] | None = None
    tree: str | None = None  # the copy of the code there
    mirror: Path | None = None  # the local copy of the manifest


def launch(args: argparse.Namespace, forwarded: list[str], script_args: list[str]) -> RemoteLaunch:
    """``auto_launch --host``: check, send, launch there."""
    from orchestrator.chain import new_chain_id

    remote = Remote(check_host(args.host), args.remote_bin)
    code = plan_code(SNAPSHOT, Path.cwd(), Path(args.remote_dir), args.code_limit_mb)
    remote.check_toolkit()
    name = new_chain_id(code.tree.name if code.tree else "launch")
    tree = remote.send_code(code if code.mode == SNAPSHOT else None, args.remote_dir, name)
    sent = describe_sent(code, remote.host, tree)
    if args.dry_run:
        print(sent, file=sys.stderr, flush=True)
    workdir = tree
    if code.mode == SNAPSHOT and code.root is not None:
        relative = code.workdir.relative_to(code.root).as_posix()
        workdir = tree if relative == "." else f"{tree}/{relative}"
    words = ["auto_launch", *forwarded]
    if args.backend == "auto":  # a login node never runs the chain itself
        words += ["--backend", "slurm"]
    if not args.dry_run:
        words.append("--json")
    if script_args:
        words += ["--", *script_args]
    keep = "" if args.dry_run else '[ "$orch_rc" = 0 ] || '  # a copy no job runs is removed
    done = remote.run(
        f"mkdir -p {shlex.quote(workdir)} && cd {shlex.quote(workdir)} && "  # may hold no file
        f"{shlex.join(words)}; orch_rc=$?; "
        f'{keep}rm -rf {shlex.quote(tree)}; exit "$orch_rc"',
        capture_stdout=not args.dry_run,
        capture_stderr=False,  # the launch's own lines (submitted job k/N...) as they come
        timeout=None,
        doing=" during the launch; `orchestrator list` there says whether it queued a chain",
    )
    if args.dry_run or done.returncode != 0:  # the host's own lines say why (bad input...)
        sys.stdout.write(done.stdout or "")
        return RemoteLaunch(done.returncode)
    print(sent, file=sys.stderr, flush=True)
    try:
        summary = json.loads(last_line(done.stdout))
    except ValueError as error:
        raise SchedulerError(
            f"{remote.host}: auto_launch printed no JSON summary: {last_line(done.stdout)!r}"
        ) from error
    summary["host"] = remote.host
    try:
        copy = mirror(remote, summary["run_dir"], tree)
    except (UsageError, SchedulerError, ValueError, OSError) as error:
        copy = None
        print(
            f"warning: chain {summary['chain_id']} is queued on {remote.host}, but its manifest "
            f"was not copied here ({error}); use orchestrator status --host {remote.host}",
            file=sys.stderr,
        )
    return RemoteLaunch(0, summary, tree, copy)


def describe_sent(code: CodeSource, host: str, tree: str) -> str:
    if code.mode != SNAPSHOT:
        return f"code: not in a git work tree, nothing copied; running in {host}:{tree}"
    commit = (code.commit or "no commit")[:12] + (" (dirty)" if code.dirty else "")
    left = f"; left out (untracked: over 10 MiB, or credentials): {', '.join(code.left_out)}"
    return (
        f"code: {code.tree} at {commit}: {len(code.files)} files, {code.size / 2**20:.1f} MiB "
        f"-> {host}:{tree}{left if code.left_out else ''}"
    )


# the local copy of a remote chain's manifest -----------------------------------------------


def mirror_dir(host: str, chain_id: str) -> Path:
    return orch_home() / "remote" / host.replace(os.sep, "_") / chain_id


def mirror(remote: Remote, run_dir: str, tree: str | None = None) -> Path:
    """Copy the chain's manifest from the host into ``$ORCH_HOME/remote/<host>/<chain>/``; at
    launch (``tree`` given) also index the chain, with the host it lives on."""
    data = json.loads(remote.read_file(f"{run_dir}/{MANIFEST_NAME}"))
    folder = mirror_dir(remote.host, data["chain_id"])
    atomic_write_json(folder / MANIFEST_NAME, data, durable=False)
    if tree is not None:
        atomic_write_json(
            index_path(data["chain_id"]),
            {
                "chain_id": data["chain_id"],
                "run_dir": str(folder),
                "created": data["created"],
                "host": remote.host,
                "remote_bin": remote.bin_dir,
                "remote_run_dir": run_dir,
                "remote_tree": tree,
            },
        )
    return folder / MANIFEST_NAME


def mirrored(chain: str) -> dict[str, Any] | None:
    """The index entry of a chain launched with --host (it names the host), else None."""
    if not chain or Path(chain).name != chain or chain in (".", ".."):
        return None
    path = index_path(chain)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and entry.get("host") else None


def remote_for(args: argparse.Namespace) -> Remote | None:
    """Where ``status``, ``logs`` or ``cancel`` of ``args.chain`` runs: ``--host``, else the
    host the chain was launched on with --host, else here (None)."""
    if args.host:
        return Remote(check_host(args.host), args.remote_bin)
    entry = mirrored(args.chain)
    if entry is None:
        return None
    return Remote(entry["host"], args.remote_bin or entry.get("remote_bin"))


def run_command(remote: Remote, args: argparse.Namespace, forwarded: list[str]) -> int:
    """``orchestrator status|logs|cancel`` there, its output printed here as it comes;
    ``status`` of a mirrored chain refreshes the local copy of its manifest."""
    done = remote.run(shlex.join(["orchestrator", *forwarded]), capture_stdout=False, timeout=None)
    sys.stderr.write(done.stderr)
    entry = mirrored(args.chain)
    if args.command == "status" and done.returncode == 0 and entry is not None:
        try:
            mirror(remote, entry["remote_run_dir"])
        except (UsageError, SchedulerError, ValueError, OSError) as error:
            print(f"warning: the local copy of the manifest was not refreshed: {error}",
                  file=sys.stderr)  # fmt: skip
    return done.returncode
