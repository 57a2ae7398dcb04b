"""The one table of exit codes (docs/local_and_cluster.md#exit-codes), held to the codes the
code names, and its cases run through the commands a user types (``auto_launch``,
``orchestrator``, ``python -m train``), each from a directory outside the checkout that must stay
empty: the exit code, and the one ``error:`` line that says why. No cluster: the local backend,
``--dry-run``, and a SLURM stand-in whose sbatch refuses the chain. The codes only a training
reaches (0 and 3 to 6 of ``python -m train``; ``auto_launch``'s 3, a local chain that failed)
are tested where they happen (test_trainer, test_self_healing, test_hang, ...)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from contract.job_end import EXIT_CONFIG, EXIT_DIVERGED, EXIT_HUNG, EXIT_NOT_SAVED, EXIT_PEER_LOST
from contract.job_env import STOP_AT
from orchestrator.errors import (
    EXIT_CHAIN_FAILED,
    EXIT_CLOSED_PIPE,
    EXIT_INTERRUPTED,
    SchedulerError,
    UsageError,
)
from tests.harness.chains import write_sub
from tests.harness.exit_codes import (
    SBATCH_REFUSAL,
    exit_code_table,
    interrupted_when,
    refusing_slurm,
)
from tests.harness.process import BIN, REPO, run_into_closed_pipe, run_tool

COMMANDS, TRAINER = "`auto_launch`, `orchestrator`", "`python -m train`"
UNCAUGHT = 1  # Python's own status after an uncaught exception: the training's own error
RECIPE = str(REPO / "recipes" / "train_tiny_fsdp2.yaml")


def test_the_table_names_every_code_and_no_other():
    table = exit_code_table()
    commands = {
        0,
        SchedulerError.exit_code,
        UsageError.exit_code,
        EXIT_CHAIN_FAILED,
        EXIT_INTERRUPTED,
        EXIT_CLOSED_PIPE,
    }
    trainer = {0, UNCAUGHT, EXIT_CONFIG, EXIT_DIVERGED, EXIT_NOT_SAVED, EXIT_HUNG, EXIT_PEER_LOST}
    assert {code for code, row in table.items() if row[COMMANDS] != "-"} == commands
    assert {code for code, row in table.items() if row[TRAINER] != "-"} == trainer


@dataclass(frozen=True)
class Case:
    """A command (``python -m train`` or a console script) and its arguments for a tmp dir, the
    exit code the table gives it, and what its one ``error:`` line says (None: no such line)."""

    tool: str
    args: Callable[[Path], list[str]]
    code: int
    error: str | None
    env: Callable[[Path], dict[str, str]] = field(default=lambda _: {})


def yaml_recipe(tmp: Path, text: str) -> str:
    path = tmp / "recipe.yaml"
    path.write_text(text)
    return str(path)


def dry_run(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["--backend", "local", "--dry-run", "--run-dir", str(tmp / "run"), *args]


def trainer(*overrides: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["-m", "train", f"run_dir={tmp / 'run'}", *overrides]


CASES = {
    "auto_launch: a dry run": Case(
        "auto_launch", lambda tmp: dry_run(str(write_sub(tmp / "job.sub", "true\n")))(tmp), 0, None
    ),
    "auto_launch: a misspelt trainer override": Case(
        "auto_launch",
        dry_run(RECIPE, "--", "train.max_step=5"),
        UsageError.exit_code,
        f"error: {RECIPE}: the trainer's config: Could not override 'train.max_step': Key "
        "'max_step' not in 'TrainLoopConfig'; did you mean train.max_steps?",
    ),
    "auto_launch: a misspelt recipe field": Case(
        "auto_launch",
        lambda tmp: dry_run(
            yaml_recipe(tmp, "template: distributed\ntaks_per_node: 2\ncommand: [echo]\n")
        )(tmp),
        UsageError.exit_code,
        "taks_per_node: unknown field (did you mean tasks_per_node?); the fields are",
    ),
    "auto_launch: sbatch refuses the chain": Case(
        "auto_launch",
        lambda tmp: [
            "--backend",
            "slurm",
            "--run-dir",
            str(tmp / "run"),
            str(write_sub(tmp / "job.sub", "true\n")),
        ],
        SchedulerError.exit_code,
        f"error: submitting job 1 of 1 failed: sbatch failed: {SBATCH_REFUSAL}",
        env=lambda tmp: refusing_slurm(tmp / "bin"),
    ),
    "orchestrator status: an unknown chain": Case(
        "orchestrator",
        lambda _: ["status", "nochain"],
        UsageError.exit_code,
        "error: unknown chain",
    ),
    "orchestrator plan: no layout fits": Case(
        "orchestrator",
        lambda _: ["plan", "--model", "llama_405b", "--gpus", "8"],
        UsageError.exit_code,
        "error: no layout fits 8 x h100 (80 GiB each): the leanest, ",
    ),
    "python -m train: a misspelt override": Case(
        "python",
        trainer("train.max_step=5"),
        EXIT_CONFIG,
        "error: Could not override 'train.max_step': Key 'max_step' not in 'TrainLoopConfig'; "
        "did you mean train.max_steps?",
    ),
    "python -m train: a misspelt section": Case(
        "python", trainer("trian.max_steps=5"), EXIT_CONFIG, "; did you mean train?"
    ),
    "python -m train: a value of the wrong type": Case(
        "python",
        trainer("train.max_steps=abc"),
        EXIT_CONFIG,
        "error: Error merging override train.max_steps=abc: Value 'abc' of type 'str' could not "
        "be converted to Integer",
    ),
    "python -m train: an unknown config": Case(
        "python", trainer("model=tnyi"), EXIT_CONFIG, "; did you mean model=tiny?"
    ),
    # A malformed stop time from the batch script fails before torch loads: the training's own
    # error, with Hydra already past the point where it made its output folder.
    "python -m train: an error of its own": Case(
        "python", trainer(), UNCAUGHT, None, env=lambda _: {STOP_AT: "soon"}
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_case_exits_as_the_table_says_with_one_error_line(name, tmp_path):
    case = CASES[name]
    here = tmp_path / "cwd"
    here.mkdir()
    done = run_tool(case.tool, *case.args(tmp_path), cwd=here, env=case.env(tmp_path), timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == case.code, done.stderr + done.stdout
    if case.error is None:
        assert errors == [], done.stderr
    else:
        assert len(errors) == 1 and case.error in errors[0], done.stderr
    if done.returncode == UNCAUGHT and case.tool == "python":
        assert "Traceback" in done.stderr, done.stderr
    assert list(here.iterdir()) == []  # no runs/local, nothing else left where it started


def test_a_closed_pipe_ends_the_command_quietly():
    """``orchestrator plan ... | head -1`` whose reader is gone before the plan is printed: the
    command ends as shell tools do on SIGPIPE, with nothing on stderr (no BrokenPipeError)."""
    done = run_into_closed_pipe("orchestrator", "plan", "--model", "llm_1b", "--gpus", "8")
    assert (done.returncode, done.stderr) == (EXIT_CLOSED_PIPE, "")


def test_a_closed_pipe_ends_the_command_quietly_before_an_error_line_too():
    """``orchestrator status X 2>&1 | head -1`` whose reader is gone before the error line: that
    line cannot be written either, and the command still ends quietly (it died of a second
    BrokenPipeError, exit 1)."""
    done = run_into_closed_pipe("orchestrator", "status", "nochain", stderr_too=True)
    assert done.returncode == EXIT_CLOSED_PIPE


def test_ctrl_c_ends_the_launch_and_cancels_the_chain(tmp_path):
    started = tmp_path / "started"
    recipe = write_sub(tmp_path / "job.sub", f"touch {started}\nsleep 60\n")
    argv = [
        str(BIN / "auto_launch"),
        "-n2",
        "--backend",
        "local",
        "--run-dir",
        str(tmp_path / "run"),
        str(recipe),
    ]
    done = interrupted_when(argv, started, cwd=tmp_path)
    assert started.exists(), done.stderr
    assert done.returncode == EXIT_INTERRUPTED, done.stderr + done.stdout
    assert done.stderr.splitlines()[-1] == "interrupted"
    assert "rolled back" in (tmp_path / "run" / "manifest.json").read_text()
