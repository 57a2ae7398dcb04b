"""The code a chain runs is the code as it was at submission (orchestrator/snapshot.py).

Which real runs these catch: a chain of 8 jobs over days, whose later jobs ran whatever the
checkout held when they started (an edit, a ``git pull``, a branch switch), not what was
launched; a snapshot that silently dropped a new untracked module or an uncommitted fix; data
under the checkout that the snapshot's jobs could no longer find by its relative path; a 5 GB
checkpoint under the tree copied into every run dir."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from contract.job_env import CODE_DIR
from contract.run_dir import CODE_DIFF, CODE_SNAPSHOT_DIR
from orchestrator.errors import UsageError
from orchestrator.manifest import Manifest
from orchestrator.snapshot import (
    DIRECTORY,
    LIVE,
    SNAPSHOT,
    UNTRACKED_FILE_LIMIT,
    freeze,
    plan_code,
)
from tests.harness.chains import launch_json, wait_chain, write_sub
from tests.harness.process import REPO, run_tool

JOB = 'print("version 1")\n'
# The job prints the version of the project's module it imports, reads data by a path relative
# to the checkout, and says where it ran.
BODY = """
python -c "import project; print('version', project.VERSION)"
cat data/samples.txt
echo "code_dir=$ORCH_CODE_DIR pwd=$PWD"
sleep "${PAUSE:-0}"
"""


def git(tree: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args],
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project: a git repo with a module, a recipe, ignored data and build outputs."""
    tree = tmp_path / "project"
    (tree / "project").mkdir(parents=True)
    (tree / "project" / "__init__.py").write_text("VERSION = 1\n")
    (tree / ".gitignore").write_text("data/\nbuild/\n__pycache__/\n")
    write_sub(tree / "run.sub", BODY)
    git(tree, "init", "-q")
    git(tree, "add", ".")
    git(tree, "commit", "-qm", "version 1")
    (tree / "data").mkdir()
    (tree / "data" / "samples.txt").write_text("the data\n")
    (tree / "build").mkdir()
    (tree / "build" / "big.bin").write_bytes(b"\0" * 1024)
    return tree


def test_a_snapshot_holds_tracked_files_as_on_disk_and_untracked_ones_git_keeps(project, tmp_path):
    (project / "project" / "__init__.py").write_text("VERSION = 2  # not committed\n")
    (project / "project" / "helper.py").write_text("X = 1\n")  # new, not yet added
    (project / "huge.bin").write_bytes(b"\0" * (UNTRACKED_FILE_LIMIT + 1))
    (project / ".env").write_text("WANDB_API_KEY=abc\n")  # untracked credentials: never copied
    (project / "run.sub").unlink()  # deleted from the tree: not in the snapshot
    code = plan_code(SNAPSHOT, project, tmp_path / "run", 200)
    assert code.mode == SNAPSHOT and code.tree == project
    assert code.commit == git(project, "rev-parse", "HEAD") and code.dirty
    assert set(code.files) == {".gitignore", "project/__init__.py", "project/helper.py"}
    assert set(code.left_out) == {"huge.bin", ".env"} and "huge.bin" in code.describe()
    assert set(code.links) == {"build", "data"}
    freeze(code)
    root = tmp_path / "run" / CODE_SNAPSHOT_DIR
    assert (root / "project" / "__init__.py").read_text() == "VERSION = 2  # not committed\n"
    assert (root / "data").is_symlink() and (root / "data" / "samples.txt").exists()
    assert "VERSION = 2" in (tmp_path / "run" / CODE_DIFF).read_text()
    assert code.env(None) == {CODE_DIR: str(root), "PYTHONPATH": str(root)}


def test_the_folder_that_holds_the_run_is_not_linked_into_its_snapshot(project):
    """A chain whose run dir is under an ignored ``runs/`` of the checkout: linking ``runs`` into
    ``runs/<run>/code`` would be a cycle, which ``pip install -e .`` (setuptools' scan of the
    checkout follows links) walked without end."""
    (project / ".gitignore").write_text("data/\nbuild/\n__pycache__/\nruns/\n")
    (project / "runs" / "earlier").mkdir(parents=True)  # git lists a folder that holds files
    (project / "runs" / "earlier" / "metrics.jsonl").write_text("{}\n")
    code = plan_code(SNAPSHOT, project, project / "runs" / "chain", 200)
    assert set(code.links) == {"build", "data"}
    freeze(code)
    root = project / "runs" / "chain" / CODE_SNAPSHOT_DIR
    assert (root / "data").is_symlink() and not os.path.lexists(root / "runs")


def test_jobs_start_in_the_snapshots_copy_of_the_current_directory(project, tmp_path):
    (project / "src").mkdir()  # a src layout goes on PYTHONPATH too
    (project / "src" / "lib.py").write_text("")
    code = plan_code(SNAPSHOT, project / "project", tmp_path / "run", 200)
    root = tmp_path / "run" / CODE_SNAPSHOT_DIR
    assert code.workdir == root / "project"
    freeze(code)
    assert code.env("/opt/site")["PYTHONPATH"] == os.pathsep.join(
        [str(root), str(root / "src"), "/opt/site"]
    )


def test_outside_a_git_tree_live_and_a_directory_are_not_copied(tmp_path, project):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert plan_code(SNAPSHOT, plain, tmp_path / "run", 200).mode == LIVE
    live = plan_code(LIVE, project, tmp_path / "run", 200)
    assert (live.mode, live.root, live.workdir, live.env(None)) == (LIVE, None, project, {})
    given = plan_code(str(project), plain, tmp_path / "run", 200)
    assert (given.mode, given.root, given.workdir) == (DIRECTORY, project, project)
    assert given.commit == git(project, "rev-parse", "HEAD")


def test_a_snapshot_over_the_limit_is_refused_naming_the_largest_files(project, tmp_path):
    (project / "weights.pt").write_bytes(b"\0" * 3 * 2**20)
    git(project, "add", "weights.pt")
    with pytest.raises(UsageError, match=r"weights\.pt \(3\.0 MiB\).*--code-limit-mb"):
        plan_code(SNAPSHOT, project, tmp_path / "run", 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--code", "/no/such/checkout"], "--code /no/such/checkout: no such directory"),
        (["--code-limit-mb", "0.0001"], "over the limit of 0.0001 MiB"),
    ],
)
def test_bad_code_options_are_one_line_exit_2_and_queue_nothing(project, tmp_path, args, message):
    run_dir = tmp_path / "run"
    done = run_tool(
        "auto_launch", "--backend", "local", "--run-dir", str(run_dir), *args, "run.sub",
        cwd=project,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert not run_dir.exists()


def test_the_toolkits_own_checkout_is_imported_from_the_snapshot(tmp_path):
    """A package installed in editable mode from the tree (this toolkit, in CI) runs from the
    snapshot: PYTHONPATH puts it before the editable install's path."""
    recipe = write_sub(
        tmp_path / "which.sub",
        'python -c "import orchestrator, train; print(orchestrator.__file__, train.__file__)"',
    )
    run_dir = tmp_path / "run"
    summary = launch_json("--backend", "local", "--run-dir", str(run_dir), str(recipe), cwd=REPO)
    assert summary["code"]["mode"] == SNAPSHOT
    log = next((run_dir / "logs").glob("which-*.out")).read_text()
    snapshot = run_dir / CODE_SNAPSHOT_DIR
    assert f"{snapshot}/orchestrator/__init__.py {snapshot}/train/__init__.py" in log, log


@pytest.mark.slurm
def test_an_edit_after_submission_does_not_reach_a_later_job(slurm_cluster, project, tmp_path):
    """The issue's case on the loopback cluster: two jobs; while the first runs, the project is
    edited and committed; the second still runs the submitted version, and the record says
    which commit, dirty or not, and the diff."""
    (project / "project" / "__init__.py").write_text("VERSION = 1.5\n")  # uncommitted at launch
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n2", "--run-dir", str(run_dir), "run.sub", cwd=project, env={**os.environ, "PAUSE": "3"}
    )
    (project / "project" / "__init__.py").write_text("VERSION = 2\n")
    git(project, "commit", "-qam", "version 2")
    final = wait_chain(summary["chain_id"])
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 2
    logs = sorted((run_dir / "logs").glob("run-*.out"))
    snapshot = run_dir / CODE_SNAPSHOT_DIR
    for log in logs:
        text = log.read_text()
        assert "version 1.5" in text and "the data" in text, text
        assert f"code_dir={snapshot} pwd={snapshot}" in text, text
    manifest = Manifest.load(run_dir / "manifest.json")
    assert manifest.git_sha == git(project, "rev-parse", "HEAD~1") and manifest.git_dirty
    assert "VERSION = 1.5" in Path(manifest.code_diff).read_text()
    status = run_tool("orchestrator", "status", summary["chain_id"])
    assert f"code: {manifest.git_sha[:12]} (dirty), snapshot {snapshot}" in status.stdout
    payload = json.loads(run_tool("orchestrator", "status", summary["chain_id"], "--json").stdout)
    assert payload["code"]["commit"] == manifest.git_sha


def test_code_live_runs_the_tree_as_each_job_finds_it(project, tmp_path):
    run_dir = tmp_path / "run"
    summary = launch_json(
        "--backend", "local", "--code", "live", "--run-dir", str(run_dir), "run.sub", cwd=project
    )
    assert summary["code"]["mode"] == LIVE and summary["code"]["dir"] is None
    assert not (run_dir / CODE_SNAPSHOT_DIR).exists()
    log = next((run_dir / "logs").glob("run-*.out")).read_text()
    assert f"code_dir= pwd={project}" in log


def test_a_sweeps_config_folder_in_the_tree_is_read_from_each_members_snapshot(monkeypatch):
    """A chained sweep's ``--config-path`` inside the work tree becomes the same folder under
    the member's ``${ORCH_CODE_DIR}``; with ``code=live``, or outside the tree, it stays."""
    from omegaconf import OmegaConf

    from hydra_plugins.orch_chain_launcher.chain_launcher import config_path_args

    sources = [
        {"schema": "file", "provider": "main", "path": str(REPO / "recipes" / "conf")},
        {"schema": "file", "provider": "command-line", "path": "/etc"},
        {"schema": "pkg", "provider": "hydra", "path": "hydra.conf"},
    ]
    config = OmegaConf.create({"hydra": {"runtime": {"config_sources": sources}}})
    monkeypatch.chdir(REPO)
    assert config_path_args(config, SNAPSHOT) == [
        "--config-path", "${ORCH_CODE_DIR}/recipes/conf", "--config-dir", "/etc",
    ]  # fmt: skip
    assert config_path_args(config, LIVE)[1] == str(REPO / "recipes" / "conf")


def test_a_replacement_job_runs_the_chains_snapshot(project, tmp_path):
    """What the chain hook queues for a failed job (--retries) starts in the snapshot with
    ORCH_CODE_DIR and PYTHONPATH, whatever the environment of the job that queues it."""
    from orchestrator.chain import ChainPlan, new_manifest, replacement_request

    plan = ChainPlan.create(
        job_name="run",
        recipe=project / "run.sub",
        script_text=(project / "run.sub").read_text(),
        num_jobs=2,
        dependency_kind="afterany",
        base_seed=1,
        run_dir=tmp_path / "run",
        workdir=project,
    )
    manifest = new_manifest(plan, "slurm")
    request = replacement_request(manifest, 2, 7, "123")
    root = tmp_path / "run" / CODE_SNAPSHOT_DIR
    assert request.workdir == root
    assert request.env[CODE_DIR] == str(root)
    assert request.env["PYTHONPATH"].split(os.pathsep)[0] == str(root)
