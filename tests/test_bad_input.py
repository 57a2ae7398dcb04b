"""Bad input: one clear error line, exit code 2, nothing submitted, no run dir left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.manifest import orch_home
from tests.harness.chains import write_sub
from tests.harness.cluster import queue_ids
from tests.harness.process import REPO, run_tool

pytestmark = pytest.mark.slurm

GOOD_BODY = "echo ok\n"


def sub(tmp_path: Path, directives: str, name: str = "job.sub") -> str:
    return str(write_sub(tmp_path / name, GOOD_BODY, directives=directives))


def raw(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CASES = {
    "missing recipe": (lambda t: ["-n2", str(t / "nope.sub")], "does not exist"),
    "recipe is a directory": (lambda t: ["-n2", str(t)], "not a file"),
    "unknown extension": (lambda t: ["-n2", raw(t, "job.txt", "#!/bin/bash\nSEED=$1\n")], ".txt"),
    "no shebang": (lambda t: ["-n2", raw(t, "job.sub", "SEED=$1\necho hi\n")], "#!"),
    "never reads the seed": (lambda t: ["-n2", raw(t, "job.sub", "#!/bin/bash\necho hi\n")], "$1"),
    "yaml syntax": (
        lambda t: ["-n2", raw(t, "r.yaml", "command: [python\n  nodes: 1\n")],
        "r.yaml",
    ),
    "yaml unknown key": (
        lambda t: ["-n2", raw(t, "r.yaml", "command: [echo, hi]\nnodez: 2\n")],
        "nodez",
    ),
    "yaml without command": (lambda t: ["-n2", raw(t, "r.yaml", "nodes: 1\n")], "command"),
    "yaml secret in env": (
        lambda t: ["-n2", raw(t, "r.yaml", "command: [echo, hi]\nenv: {WANDB_API_KEY: abc}\n")],
        "WANDB_API_KEY",
    ),
    "yaml program not on PATH": (
        lambda t: ["-n2", raw(t, "r.yaml", "command: [no-such-trainer, hi]\n")],
        "no-such-trainer is not on PATH",
    ),
    "zero jobs": (lambda t: ["-n0", sub(t, "#SBATCH --time=5")], "at least 1"),
    "negative jobs": (lambda t: ["-n", "-3", sub(t, "#SBATCH --time=5")], "at least 1"),
    "jobs not a number": (lambda t: ["-n", "three", sub(t, "#SBATCH --time=5")], "invalid int"),
    "unknown dependency": (
        lambda t: ["--dependency", "afterburn", sub(t, "#SBATCH --time=5")],
        "afterburn",
    ),
    "negative seed": (lambda t: ["--seed", "-1", sub(t, "#SBATCH --time=5")], "out of range"),
    "seed too large": (
        lambda t: ["--seed", str(2**31), sub(t, "#SBATCH --time=5")],
        "out of range",
    ),
    "unknown backend": (lambda t: ["--backend", "k8s", sub(t, "#SBATCH --time=5")], "k8s"),
    "bad job name": (lambda t: ["--name", "a b;c", sub(t, "#SBATCH --time=5")], "job name"),
    "run dir is a file": (
        lambda t: ["--run-dir", raw(t, "afile", "x"), sub(t, "#SBATCH --time=5")],
        "not a directory",
    ),
    "run dir not writable": (
        lambda t: ["--run-dir", "/proc/1/run", sub(t, "#SBATCH --time=5")],
        "not writable",
    ),
    "run dir with a comma": (
        lambda t: ["--run-dir", str(t / "a,b"), sub(t, "#SBATCH --time=5")],
        "','",
    ),
    "too many nodes": (lambda t: [sub(t, "#SBATCH --nodes=5")], "5 nodes asked"),
    "too many cpus": (lambda t: [sub(t, "#SBATCH --cpus-per-task=64")], "CPUs"),
    "gpus on a cpu cluster": (lambda t: [sub(t, "#SBATCH --gpus-per-node=8")], "GPUs"),
    "unknown partition": (lambda t: [sub(t, "#SBATCH --partition=gpu-h100")], "gpu-h100"),
    "malformed time": (lambda t: [sub(t, "#SBATCH --time=soon")], "soon"),
    "unknown signal": (lambda t: [sub(t, "#SBATCH --signal=B:USR9@60")], "USR9"),
    "nodes not a number": (lambda t: [sub(t, "#SBATCH --nodes=two")], "--nodes=two"),
    "missing --then recipe": (
        lambda t: ["--then", str(t / "eval.yaml"), sub(t, "#SBATCH --time=5")],
        "error: --then: recipe",
    ),
    "invalid --then recipe": (
        lambda t: ["--then", raw(t, "eval.yaml", "nodes: 1\n"), sub(t, "#SBATCH --time=5")],
        "error: --then: recipe",
    ),
    "--then program not on PATH": (
        lambda t: [
            "--then",
            raw(t, "eval.yaml", "command: [no-such-evaluator]\n"),
            sub(t, "#SBATCH --time=5"),
        ],
        "error: --then: no-such-evaluator is not on PATH",
    ),
    "--then recipe too big": (
        lambda t: ["--then", sub(t, "#SBATCH --nodes=5", "eval.sub"), sub(t, "#SBATCH --time=5")],
        "error: --then: 5 nodes asked",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_refused_before_submission(case, slurm_cluster, tmp_path):
    make_args, expected = CASES[case]
    args = make_args(tmp_path)
    before = queue_ids()
    files_before = set(tmp_path.iterdir())
    runs = orch_home() / "runs"
    runs_before = set(runs.iterdir()) if runs.exists() else set()
    completed = run_tool("auto_launch", *args)
    assert completed.returncode == 2, (case, completed.stdout, completed.stderr)
    error_lines = [line for line in completed.stderr.splitlines() if line.startswith("error:")]
    assert error_lines or "usage:" in completed.stderr, completed.stderr
    assert expected in completed.stderr, (case, completed.stderr)
    assert queue_ids() == before
    assert set(tmp_path.iterdir()) == files_before
    assert (set(runs.iterdir()) if runs.exists() else set()) == runs_before


def test_slurm_backend_without_a_controller(tmp_path):
    recipe = sub(tmp_path, "#SBATCH --time=5")
    completed = run_tool(
        "auto_launch",
        "--backend",
        "slurm",
        recipe,
        env={"SLURM_CONF": str(tmp_path / "missing.conf")},
    )
    assert completed.returncode == 2
    assert "no SLURM controller answers" in completed.stderr


def test_local_backend_refuses_several_nodes(tmp_path):
    recipe = sub(tmp_path, "#SBATCH --nodes=2")
    completed = run_tool("auto_launch", "--backend", "local", recipe)
    assert completed.returncode == 2
    assert "local backend runs one node" in completed.stderr
    assert "orchestrator cluster up" in completed.stderr


def test_a_shell_without_the_toolkits_environment_is_told_to_activate_it(tmp_path):
    """auto_launch run by its path from a shell that never activated the venv: the jobs would
    inherit that PATH, find no torchrun and each exit 127. Refused before anything is made."""
    run_dir = tmp_path / "run"
    completed = run_tool(
        "auto_launch",
        "--backend",
        "local",
        "--run-dir",
        str(run_dir),
        str(REPO / "recipes" / "train_tiny_fsdp2.yaml"),
        env={"PATH": "/usr/bin:/bin"},
    )
    assert completed.returncode == 2, completed.stderr
    assert "error: torchrun is not on PATH" in completed.stderr
    assert "source .venv/bin/activate" in completed.stderr
    assert not run_dir.exists()


EXEMPT_FROM_PATH = {
    "container": "command: [no-such-trainer]\ncontainer: {image: nvcr.io/nvidia/pytorch:24.01}\n",
    "env sets PATH": "command: [no-such-trainer]\nenv: {PATH: /opt/trainer/bin}\n",
    "absolute path": "command: [/opt/no-such/trainer]\n",
    "expanded path": 'command: ["${ORCH_CODE_DIR}/no-such-trainer"]\n',
}


@pytest.mark.parametrize("case", sorted(EXEMPT_FROM_PATH))
def test_a_program_the_jobs_do_not_look_up_on_this_path_is_not_refused(case, tmp_path):
    """The PATH check's exemptions: the same missing program as the refused case above, found
    through the container's image, the recipe's own PATH or a path instead."""
    recipe = raw(tmp_path, "r.yaml", EXEMPT_FROM_PATH[case])
    completed = run_tool("auto_launch", "--backend", "local", "--dry-run", "-n1", recipe)
    assert completed.returncode == 0, completed.stderr
    assert "is not on PATH" not in completed.stderr
