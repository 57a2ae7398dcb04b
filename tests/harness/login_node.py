"""A "login node" on 127.0.0.1 that shares nothing with the laptop it should not.

``login_node()`` starts Debian's OpenSSH server at a free port, with a host key of its own, where
the test key logs in as a second Unix user (``make setup-system`` adds it). That user has its own
home, ORCH_HOME and code copies there, and cannot read the launching user's files (a pytest
temporary directory is mode 0700): a laptop path that leaks into a remote command fails there.
It runs the toolkit from an environment it can read but not write, built from the project's
wheel (``remote_toolkit``), and submits to the loopback cluster as itself (whose folder must be
open to every user, as a real cluster's are: ``open_to_every_user``). The launches use the
server through ``ORCH_SSH="ssh -F CONFIG"`` and a host alias.

Shared by tests/test_remote_launch.py and bench/bench_remote_launch.py.
"""

from __future__ import annotations

import importlib.metadata as metadata
import pwd
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.harness.process import REPO, missing_capability
from tests.harness.wheel import build_wheel, run

HOST = "orch-login"  # the test sshd, by the alias of the test's ssh config
CLOSED = "orch-closed"  # 127.0.0.1 at a port nothing listens on
SSHD_INSTALL = "make setup-system (apt-get install -y openssh-server)"
TOOLKIT_SCRIPTS = ("auto_launch", "orchestrator")


@dataclass(frozen=True)
class LoginNode:
    directory: Path  # the server's keys and configs (readable by the remote user)
    user: str  # who the test key logs in as
    area: Path  # this session's folder in that user's home: its ORCH_HOME, its copies
    bin_dir: Path  # the toolkit there (read-only to the user)
    env: dict[str, str]  # what the local commands get: ORCH_SSH, ORCH_REMOTE_BIN

    @property
    def remote_home(self) -> Path:
        """The login node's ORCH_HOME."""
        return self.area / "orch_home"

    def remote_path(self, name: str) -> str:
        """``name`` in this session's folder, as a ``~`` path the remote shell expands."""
        return f"~/{self.area.name}/{name}"


def remote_user() -> pwd.struct_passwd:
    """The second Unix user ``make setup-system`` adds (its name is the Makefile's)."""
    name = run(["make", "-s", "-C", REPO, "print-REMOTE_TEST_USER"], REPO).strip()
    try:
        return pwd.getpwnam(name)
    except KeyError:
        missing_capability(f"no Unix user {name}: run make setup-system (as root)")


def as_user(user: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", user, "--", *argv], capture_output=True, text=True, **kwargs
    )


def python_for(user: str) -> str:
    """An interpreter of this Python's version that ``user`` can run: this environment's base,
    unless it lies under a home the user cannot enter (pyenv's under /root), else the system's."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys._base_executable, f"/usr/bin/{version}"):
        if as_user(user, [candidate, "-c", ""], timeout=30).returncode == 0:
            return candidate
    missing_capability(f"no {version} that the user {user} can run (apt-get install {version})")


def remote_toolkit(root: Path, user: str) -> Path:
    """The bin folder of an environment ``user`` can run and not write: a venv of
    ``python_for(user)`` with the project's wheel installed, whose dependencies are a hard-linked
    copy of this environment's site-packages less the editable install (no path back to the
    checkout). Building one with torch from the wheelhouse would cost minutes."""
    venv = root / "venv"
    root.mkdir()
    run([python_for(user), "-m", "venv", "--without-pip", venv], root)
    [site_packages] = (venv / "lib").glob("python*/site-packages")
    deps = root / "deps"
    mine = sysconfig.get_paths()["purelib"]
    if subprocess.run(["cp", "-al", mine, deps], capture_output=True).returncode != 0:
        shutil.rmtree(deps, ignore_errors=True)  # another filesystem: a copy then
        run(["cp", "-a", mine, deps], root)
    ours = metadata.packages_distributions()["orchestrator"][0]
    editable = [*deps.glob("__editable__.*"), *deps.glob(f"{ours.replace('-', '_')}-*.dist-info")]
    for leak in editable:
        shutil.rmtree(leak) if leak.is_dir() else leak.unlink()
    (site_packages / "toolkit_deps.pth").write_text(f"{deps}\n")
    wheel = build_wheel(root / "build")
    run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q",
         "--no-deps", "--no-index", wheel], root)  # fmt: skip
    shutil.rmtree(root / "build")
    root.chmod(0o755)
    return venv / "bin"


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
            raise RuntimeError(f"sshd exited ({server.returncode}):\n{log.read_text()}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"sshd not listening on port {port} after 10 s:\n{log.read_text()}")


@contextmanager
def login_node(slurm_conf: Path) -> Iterator[LoginNode]:
    """The server, for as long as the ``with`` lasts; then its files and the session's folder in
    the remote user's home are removed."""
    server_binary = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(server_binary).is_file() or not shutil.which("ssh-keygen"):
        missing_capability(f"OpenSSH's server is not installed: run {SSHD_INSTALL}")
    user = remote_user()
    if as_user(user.pw_name, ["test", "-r", str(slurm_conf)], timeout=30).returncode != 0:
        raise RuntimeError(
            f"the user {user.pw_name} cannot read {slurm_conf}: start the cluster in a folder "
            "every user can reach (tests.harness.cluster.open_to_every_user)"
        )
    directory = Path(tempfile.mkdtemp(prefix="orch-login-"))  # /tmp: the remote user reads it
    area = Path(user.pw_dir) / directory.name
    server: subprocess.Popen | None = None
    try:
        directory.chmod(0o755)
        keygen(directory / "host_key")
        keygen(directory / "client_key")
        shutil.copy(directory / "client_key.pub", directory / "authorized_keys")
        bin_dir = remote_toolkit(directory / "toolkit", user.pw_name)
        area.mkdir(mode=0o700)
        shutil.chown(area, user.pw_uid, user.pw_gid)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        port, closed = free_port(), free_port()
        (directory / "sshd_config").write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {directory}/host_key\n"
            f"PidFile {directory}/sshd.pid\nAuthorizedKeysFile {directory}/authorized_keys\n"
            "PermitRootLogin no\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\nPrintMotd no\n"
            "AcceptEnv SLURM_CONF ORCH_HOME\n"
        )
        client = (
            f"  HostName 127.0.0.1\n  User {user.pw_name}\n"
            f"  IdentityFile {directory}/client_key\n  IdentitiesOnly yes\n  IdentityAgent none\n"
            f"  UserKnownHostsFile {directory}/known_hosts\n  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking accept-new\n  LogLevel ERROR\n"
        )
        (directory / "ssh_config").write_text(
            f"Host {HOST}\n  Port {port}\n{client}"
            f"  SetEnv SLURM_CONF={slurm_conf} ORCH_HOME={area / 'orch_home'}\n"
            f"Host {CLOSED}\n  Port {closed}\n{client}"
        )
        log = directory / "sshd.log"
        with open(log, "w") as sink:
            server = subprocess.Popen(
                [server_binary, "-D", "-e", "-f", str(directory / "sshd_config")],
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        wait_listening(port, server, log)
        env = {"ORCH_SSH": f"ssh -F {directory}/ssh_config", "ORCH_REMOTE_BIN": str(bin_dir)}
        yield LoginNode(directory, user.pw_name, area, bin_dir, env)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        shutil.rmtree(area, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)
