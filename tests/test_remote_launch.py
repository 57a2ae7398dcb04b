"""``auto_launch --host``: a launch from a laptop over SSH (orchestrator/remote.py).

Which real runs these catch: a chain that ran the login node's stale checkout instead of the
code on the laptop; a launch to a host that does not answer that hangs, or leaves half a copy
and a queued job behind; a login node with another version of the toolkit, or none on the
PATH ssh gets, that fails deep inside with a traceback; a value with a space or a ``$(...)``
that the remote shell split or ran.

The ``sshd`` fixture is a "login node" (tests/harness/login_node.py): Debian's OpenSSH server on
127.0.0.1 where the test key logs in as a second Unix user, with its own home, ORCH_HOME and code
copies, who cannot read the launching user's files (the project, its run dirs, the local
ORCH_HOME: pytest's temporary tree is mode 0700). So a laptop path that leaks into the remote
side fails there. That user runs the toolkit from an environment built from the project's wheel
that it can read but not write, and submits to the loopback cluster as itself.
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import __version__
from orchestrator.cli.launch_arguments import auto_launch_parser
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
from tests.harness.login_node import CLOSED, HOST, LoginNode, login_node
from tests.harness.process import run_tool

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


# a login node on 127.0.0.1, as another user -------------------------------------------------


@pytest.fixture(scope="module")
def sshd(slurm_cluster: LoopbackCluster) -> Iterator[LoginNode]:
    with login_node(slurm_cluster.conf) as node, pytest.MonkeyPatch.context() as patch:
        for name, value in node.env.items():
            patch.setenv(name, value)  # the orchestrator commands run by wait_chain too
        yield node


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
def test_a_chain_launched_over_ssh_runs_the_code_that_went_over(sshd, project):
    token = f"sent from the laptop {time.time_ns()}"
    (project / "message.txt").write_text(token + "\n")  # untracked, uncommitted: it must go over
    remote_root = sshd.area / "remote root"  # a space: every path is quoted on the host
    summary = launch_json(
        "--host", HOST, "--remote-dir", sshd.remote_path("remote root"), "-n2",
        "--run-dir", "runs/r1", "run.sub",
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
def test_a_dry_run_over_ssh_renders_there_and_leaves_nothing(sshd, project):
    remote_root = sshd.area / "dry"
    before = queue_ids()
    done = run_tool(
        "auto_launch", "--host", HOST, "--remote-dir", sshd.remote_path("dry"), "--dry-run",
        "run.sub",
        cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "backend slurm, dry run" in done.stdout and "sbatch --test-only:" in done.stdout
    assert list(remote_root.iterdir()) == [] and queue_ids() == before


@pytest.mark.slurm
def test_bad_input_found_on_the_host_is_its_one_line_and_leaves_no_copy(sshd, project):
    remote_root = sshd.area / "bad input"
    done = run_tool(
        "auto_launch", "--host", HOST, "--remote-dir", sshd.remote_path("bad input"),
        "missing.sub",
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
        "auto_launch", "--host", HOST, "--remote-dir", sshd.remote_path("baseline"),
        "missing.sub",
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
def test_a_host_without_this_toolkit_is_one_line_naming_the_fix(sshd, project, toolkit):
    fake_bin = sshd.area / f"bin, {toolkit}"  # where the remote user can read it
    fake_bin.mkdir()
    if toolkit == "other version":
        fake = fake_bin / "orchestrator"
        fake.write_text("#!/bin/sh\necho orchestrator 0.0.1\n")
        fake.chmod(0o755)
        expected = f"version 0.0.1, this one {__version__}"
    else:
        expected = "the toolkit is not on --remote-bin"
    remote_root = f"copies, {toolkit}"
    done = run_tool(
        "auto_launch", "--host", HOST, "--remote-dir", sshd.remote_path(remote_root), "run.sub",
        cwd=project, env={"ORCH_REMOTE_BIN": str(fake_bin)},
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert expected in done.stderr and "--remote-bin DIR" in done.stderr, done.stderr
    assert not (sshd.area / remote_root).exists()


@pytest.mark.slurm
def test_a_copy_that_cannot_be_written_is_one_line_and_queues_nothing(sshd, project):
    (sshd.area / "a file").write_text("")  # the remote root cannot be made under it
    before = queue_ids()
    done = run_tool(
        "auto_launch", "--host", HOST, "--remote-dir", sshd.remote_path("a file/launches"),
        "run.sub",
        cwd=project,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "copying the code to" in done.stderr and "Not a directory" in done.stderr
    assert queue_ids() == before


@pytest.mark.slurm
def test_the_login_node_user_cannot_read_the_launching_users_files(sshd, project):
    """What makes the tests above catch a leaked laptop path: on the host, the project, the
    laptop's ORCH_HOME are out of reach; the toolkit there is its own, read-only."""
    for path in (project / "run.sub", Path(os.environ["ORCH_HOME"])):
        probe = Remote(HOST).run(f"test -r {shlex.quote(str(path))} || echo unreadable")
        assert (probe.returncode, probe.stdout.strip()) == (0, "unreadable"), (path, probe)
    whoami = Remote(HOST, str(sshd.bin_dir)).run(
        'id -un; touch "$(command -v orchestrator)" 2>&1 || true'
    )
    assert whoami.stdout.splitlines()[0] == sshd.user != getpass.getuser()
    assert "Permission denied" in whoami.stdout
