"""``auto_launch --host``: a launch from a laptop over SSH (orchestrator/remote.py).

Which real runs these catch: a chain that ran the login node's stale checkout instead of the
code on the laptop; a launch to a host that does not answer that hangs, or leaves half a copy
and a queued job behind; a login node with another version of the toolkit, or none on the
PATH ssh gets, that fails deep inside with a traceback; a value with a space or a ``$(...)``
that the remote shell split or ran.

The ``sshd`` fixture starts Debian's OpenSSH server on 127.0.0.1 at a free port with a host key
of its own, accepting a test key, with a client config of its own that the launches use through
``ORCH_SSH="ssh -F CONFIG"``. The remote session gets the loopback cluster's ``SLURM_CONF`` and
an ``ORCH_HOME`` of its own through ``SetEnv``/``AcceptEnv``, and finds the toolkit through
``ORCH_REMOTE_BIN`` (this venv's bin). The code goes to a separate remote root: the jobs can
only have run the copy that went over.
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator import __version__
from orchestrator.cli import auto_launch_parser
from orchestrator.errors import UsageError
from orchestrator.remote import (
    Remote,
    check_host,
    forwarded_argv,
    shell_path,
    strip_options,
)
from tests.harness.chains import launch_json, wait_chain, write_sub
from tests.harness.cluster import LoopbackCluster, queue_ids
from tests.harness.process import BIN, run_tool

HOST = "orch-login"  # the test sshd, by the alias of the test's ssh config
CLOSED = "orch-closed"  # 127.0.0.1 at a port nothing listens on
SSHD_INSTALL = "make setup-system (apt-get install -y openssh-server)"

BODY = """
cat message.txt
echo "code_dir=$ORCH_CODE_DIR pwd=$PWD"
"""


# the command lines, without a host ---------------------------------------------------------


def test_host_options_are_stripped_and_the_rest_forwarded_as_given():
    argv = ["--host", "h", "-n2", "--remote-dir=~/x", "--remote-bin", "/b", "r.sub", "--", "--host"]
    assert strip_options(argv, ["--host", "--remote-dir", "--remote-bin"]) == [
        "-n2", "r.sub", "--", "--host",
    ]  # fmt: skip
    with pytest.raises(UsageError, match="in full"):  # argparse takes --ho for --host
        forwarded_argv(auto_launch_parser(), ["--ho", "h", "r.sub"])
    with pytest.raises(UsageError, match=r"\[user@\]HOST"):
        check_host("-oProxyCommand=touch /tmp/x")


def test_the_ssh_command_is_orch_ssh_in_batch_mode_with_a_short_connect_timeout(monkeypatch):
    monkeypatch.setenv("ORCH_SSH", "ssh -F '/cfg dir/config'")
    argv = Remote("me@login", "~/envs/orch/bin").ssh_argv("orchestrator --version")
    assert argv[:3] == ["ssh", "-F", "/cfg dir/config"]
    assert argv[3:9] == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "--", "me@login"]
    assert argv[9] == 'PATH="$HOME"/envs/orch/bin:"$PATH"; export PATH; orchestrator --version'
    assert shell_path("/a b/c") == "'/a b/c'" and shell_path("~") == '"$HOME"'


def test_the_remote_shell_takes_every_value_literally(tmp_path):
    """What the host's shell gets: ``~`` is its home, a ``$(...)`` or a space is data."""
    words = ["printf", "%s|", "$(touch pwned)", "a b", "*"]
    script = Remote("h", "~/my env/bin").script(shlex.join(words) + '; printf %s "$PATH"')
    done = subprocess.run(
        ["sh", "-c", script], cwd=tmp_path, capture_output=True, text=True,
        env={"HOME": "/home/u", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.stdout == "$(touch pwned)|a b|*|/home/u/my env/bin:/usr/bin:/bin", done.stderr
    assert not (tmp_path / "pwned").exists()


# a real sshd on 127.0.0.1 ------------------------------------------------------------------


@dataclass(frozen=True)
class Sshd:
    directory: Path
    remote_home: Path  # the host's ORCH_HOME
    env: dict[str, str]  # what the local commands get: ORCH_SSH, ORCH_REMOTE_BIN


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "orch-test", "-f", str(path)],
        check=True,
        timeout=30,
    )


def wait_listening(port: int, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"sshd exited ({server.returncode}):\n{log.read_text()}", pytrace=False)
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    pytest.fail(f"sshd not listening on port {port} after 10 s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def sshd(
    tmp_path_factory: pytest.TempPathFactory, slurm_cluster: LoopbackCluster
) -> Iterator[Sshd]:
    server_binary = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(server_binary).is_file() or not shutil.which("ssh-keygen"):
        pytest.fail(f"OpenSSH's server is not installed: run {SSHD_INSTALL}", pytrace=False)
    directory = tmp_path_factory.mktemp("ssh")
    keygen(directory / "host_key")
    keygen(directory / "client_key")
    (directory / "authorized_keys").write_text((directory / "client_key.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    port, closed = free_port(), free_port()
    remote_home = directory / "remote_home"
    (directory / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {directory}/host_key\n"
        f"PidFile {directory}/sshd.pid\nAuthorizedKeysFile {directory}/authorized_keys\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\nPrintMotd no\n"
        "AcceptEnv SLURM_CONF ORCH_HOME\n"
    )
    client = (
        f"  HostName 127.0.0.1\n  User {getpass.getuser()}\n"
        f"  IdentityFile {directory}/client_key\n  IdentitiesOnly yes\n  IdentityAgent none\n"
        f"  UserKnownHostsFile {directory}/known_hosts\n  GlobalKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking accept-new\n  LogLevel ERROR\n"
    )
    (directory / "ssh_config").write_text(
        f"Host {HOST}\n  Port {port}\n{client}"
        f"  SetEnv SLURM_CONF={slurm_cluster.conf} ORCH_HOME={remote_home}\n"
        f"Host {CLOSED}\n  Port {closed}\n{client}"
    )
    log = directory / "sshd.log"
    with open(log, "w") as sink:
        server = subprocess.Popen(
            [server_binary, "-D", "-e", "-f", str(directory / "sshd_config")],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_listening(port, server, log)
        env = {"ORCH_SSH": f"ssh -F {directory}/ssh_config", "ORCH_REMOTE_BIN": str(BIN)}
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)  # the orchestrator commands run by wait_chain too
            yield Sshd(directory, remote_home, env)
    finally:
        server.terminate()
        server.wait(timeout=10)


def git(tree: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args],
        cwd=tree, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project on the laptop: a git repo with a recipe; the job prints a file that is
    written (untracked) just before the launch, and where it runs."""
    tree = tmp_path / "project"
    tree.mkdir()
    (tree / ".gitignore").write_text("runs/\n")
    write_sub(tree / "run.sub", BODY)
    git(tree, "init", "-q")
    git(tree, "add", ".")
    git(tree, "commit", "-qm", "the recipe")
    return tree


def chain_index(home: Path) -> set[str]:
    return {path.stem for path in (home / "chains").glob("*.json")}


@pytest.mark.slurm
def test_a_chain_launched_over_ssh_runs_the_code_that_went_over(sshd, project, tmp_path):
    token = f"sent from the laptop {time.time_ns()}"
    (project / "message.txt").write_text(token + "\n")  # untracked, uncommitted: it must go over
    remote_root = tmp_path / "remote root"  # a space: every path is quoted on the host
    summary = launch_json(
        "--host", HOST, "--remote-dir", str(remote_root), "-n2", "--run-dir", "runs/r1", "run.sub",
        cwd=project,
    )  # fmt: skip
    chain = summary["chain_id"]
    assert summary["host"] == HOST and summary["backend"] == "slurm"
    (tree,) = remote_root.iterdir()  # the copy; --run-dir was relative to it
    run_dir = tree / "runs" / "r1"
    assert summary["run_dir"] == str(run_dir) and not (project / "runs").exists()
    commit = git(project, "rev-parse", "HEAD")
    assert summary["code"]["commit"] == commit and summary["code"]["dirty"]  # recorded there
    final = wait_chain(chain, timeout=60)  # status, as it finds the chain's host by itself
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 2
    snapshot = run_dir / "code"
    for log in sorted((run_dir / "logs").glob("run-*.out")):
        assert token in log.read_text() and f"code_dir={snapshot} pwd={snapshot}" in log.read_text()

    status = run_tool("orchestrator", "status", "--host", HOST, chain)
    assert status.returncode == 0, status.stderr
    assert f"code: {commit[:12]} (dirty), snapshot {snapshot}" in status.stdout
    logs = run_tool("orchestrator", "logs", chain, "--job", "1")
    assert logs.returncode == 0 and token in logs.stdout, logs.stderr
    listed = run_tool("orchestrator", "list")
    assert f"{HOST}:{run_dir}" in listed.stdout and chain in listed.stdout, listed.stdout
    mirror = json.loads(Path(os.environ["ORCH_HOME"], "remote", HOST, chain, "manifest.json")
                        .read_text())  # fmt: skip
    assert mirror["run_dir"] == str(run_dir) and len(mirror["jobs"]) == 2
    assert chain in chain_index(sshd.remote_home)  # the chain's own record stays on the host
    cancelled = run_tool("orchestrator", "cancel", chain)
    assert cancelled.stdout.strip() == f"chain {chain}: cancelled 0 job(s)", cancelled.stderr


@pytest.mark.slurm
def test_a_dry_run_over_ssh_renders_there_and_leaves_nothing(sshd, project, tmp_path):
    remote_root = tmp_path / "remote"
    before = queue_ids()
    done = run_tool(
        "auto_launch", "--host", HOST, "--remote-dir", str(remote_root), "--dry-run", "run.sub",
        cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "backend slurm, dry run" in done.stdout and "sbatch --test-only:" in done.stdout
    assert list(remote_root.iterdir()) == [] and queue_ids() == before


@pytest.mark.slurm
def test_bad_input_found_on_the_host_is_its_one_line_and_leaves_no_copy(sshd, project, tmp_path):
    remote_root = tmp_path / "remote"
    done = run_tool(
        "auto_launch", "--host", HOST, "--remote-dir", str(remote_root), "missing.sub",
        cwd=project,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == "error: recipe missing.sub does not exist", done.stderr
    assert list(remote_root.iterdir()) == []


@pytest.mark.slurm
def test_an_unreachable_host_is_one_line_within_seconds_and_queues_nothing(sshd, project, tmp_path):
    """A host whose port refuses fails at once: within twice the time of a reachable host's
    one-line refusal (ssh in, the remote tool's start, its error) measured just before under
    the same load, not after retries or a connection timeout."""
    remote_root, home = tmp_path / "remote", Path(os.environ["ORCH_HOME"])
    before, indexed = queue_ids(), chain_index(home)
    started = time.monotonic()
    reachable = run_tool(
        "auto_launch", "--host", HOST, "--remote-dir", str(tmp_path / "baseline"), "missing.sub",
        cwd=project,
    )  # fmt: skip
    baseline = time.monotonic() - started
    assert reachable.returncode == 2, reachable.stderr
    started = time.monotonic()
    done = run_tool(
        "auto_launch", "--host", CLOSED, "--remote-dir", str(remote_root), "-n2", "run.sub",
        cwd=project,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode == 2 and elapsed < 2 * baseline, (elapsed, baseline, done.stderr)
    assert done.stderr.startswith(f"error: --host {CLOSED}: ssh failed (") and (
        "Connection refused" in done.stderr and done.stderr.strip().count("\n") == 0
    ), done.stderr
    assert done.stderr.strip().endswith("Nothing was queued") and done.stdout == ""
    assert queue_ids() == before and chain_index(home) == indexed
    assert not remote_root.exists() and not (project / "runs").exists()
    status = run_tool("orchestrator", "status", "--host", CLOSED, "some-chain")
    assert status.returncode == 2 and status.stderr.count("\n") == 1, status.stderr


@pytest.mark.slurm
@pytest.mark.parametrize("toolkit", ["missing", "other version"])
def test_a_host_without_this_toolkit_is_one_line_naming_the_fix(sshd, project, tmp_path, toolkit):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    if toolkit == "other version":
        fake = fake_bin / "orchestrator"
        fake.write_text("#!/bin/sh\necho orchestrator 0.0.1\n")
        fake.chmod(0o755)
        expected = f"version 0.0.1, this one {__version__}"
    else:
        expected = "the toolkit is not on --remote-bin"
    remote_root = tmp_path / "remote"
    done = run_tool(
        "auto_launch", "--host", HOST, "--remote-dir", str(remote_root), "run.sub",
        cwd=project, env={"ORCH_REMOTE_BIN": str(fake_bin)},
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert expected in done.stderr and "--remote-bin DIR" in done.stderr, done.stderr
    assert not remote_root.exists()


@pytest.mark.slurm
def test_a_copy_that_cannot_be_written_is_one_line_and_queues_nothing(sshd, project, tmp_path):
    in_the_way = tmp_path / "a file"  # the remote root cannot be made
    in_the_way.write_text("")
    before = queue_ids()
    done = run_tool(
        "auto_launch", "--host", HOST, "--remote-dir", str(in_the_way / "launches"), "run.sub",
        cwd=project,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "copying the code to" in done.stderr and "Not a directory" in done.stderr
    assert queue_ids() == before
