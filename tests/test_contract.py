"""The shared contract: one-way imports, and the facts whose copies had drifted apart."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from contract.credentials import looks_secret
from contract.job_end import EXIT_CHAIN_ENDED, EXITED_PREFIX
from contract.job_env import PORT_BASE, PORT_SPAN
from contract.slurm_states import END_STATES, ENDING_STATES, has_ended
from orchestrator.backends.base import JobStatus
from orchestrator.cli.follow_logs import follow
from orchestrator.errors import UsageError
from orchestrator.manifest import JobRecord, Manifest
from orchestrator.recipe import parse_recipe
from orchestrator.render import render_recipe
from tests.harness.graphs import circles
from tests.harness.process import REPO, imports_alike, run_python
from train.metrics import scrub_secrets

# Which top-level packages each package of the project may import (besides third parties).
ALLOWED = {
    "contract": {"contract"},
    "train": {"contract", "train"},
    "orchestrator": {"contract", "train", "orchestrator"},
    "hydra_plugins": {"contract", "train", "orchestrator", "hydra_plugins"},
    # The benchmarks drive the product as users do; three of them borrow the test harness's
    # machinery (a login node, a training rank, the conversation mixture: its charter says so).
    "bench": {"contract", "train", "orchestrator", "recipes", "tests", "bench"},
}
PROJECT = set(ALLOWED) | {"recipes", "templates", "tests"}
PRODUCT = ("contract", "train", "orchestrator", "hydra_plugins")
TESTS = REPO / "tests"
# Imports each module named in argv in this one process; names those that fail, with why.
IMPORT_EACH = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(f"{name}: {traceback.format_exc(limit=-1)}")
sys.exit("\\n".join(failed) or None)
"""


def imported_packages(path: Path) -> set[str]:
    """The top-level packages a module imports anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def sys_path_edits(path: Path) -> list[int]:
    """The lines of a module that change ``sys.path``: a method called on it, or an assignment."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            targets = [node.func.value]
        elif isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        else:
            continue
        if any(ast.unparse(target) == "sys.path" for target in targets):
            lines.append(node.lineno)
    return sorted(lines)


# A benchmark started by its file's path (its folder first on sys.path) instead of as a module.
STARTED_BY_PATH = re.compile(r"(python3?|\$\(PY\)|\"\$PYTHON\") bench/\w+\.py")


def test_benchmarks_run_as_modules_of_their_package(tmp_path) -> None:
    """bench/ is a package run from the repository root as ``python -m bench.NAME``: no module
    of it edits ``sys.path`` to reach the toolkit or a sibling, and nothing starts one by its
    path (the docs, the Makefile, the benchmarks and the GPU check's script)."""
    planted = tmp_path / "planted.py"
    planted.write_text("import sys\nsys.path.insert(0, 'x')\nsys.path = []\nsys.path += ['y']\n")
    assert sys_path_edits(planted) == [2, 3, 4]
    assert STARTED_BY_PATH.search('exec "$PYTHON" bench/gpu_check.py "$@"')
    assert (REPO / "bench" / "__init__.py").exists()
    edits = {
        str(path.relative_to(REPO)): found
        for path in sorted((REPO / "bench").glob("*.py"))
        if (found := sys_path_edits(path))
    }
    assert edits == {}, f"these benchmarks edit sys.path: {edits}"
    texts = [REPO / "Makefile", REPO / "README.md", *(REPO / "docs").glob("*.md")]
    texts += sorted((REPO / "bench").glob("*.*"))
    by_path = [str(p.relative_to(REPO)) for p in texts if STARTED_BY_PATH.search(p.read_text())]
    assert by_path == [], f"these start a benchmark by its path: {by_path}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_dependencies_run_one_way(package: str) -> None:
    """contract <- train <- orchestrator <- hydra_plugins: a package imports only those before
    it (lazy imports included), and contract only the standard library."""
    wrong = {}
    for path in sorted((REPO / package).rglob("*.py")):
        imported = imported_packages(path)
        bad = (imported & PROJECT) - ALLOWED[package]
        if package == "contract":
            bad |= imported - ALLOWED[package] - set(sys.stdlib_module_names) - {"__future__"}
        if bad:
            wrong[str(path.relative_to(REPO))] = sorted(bad)
    assert wrong == {}, f"imports against the direction contract <- train <- orchestrator: {wrong}"


def imported_modules(path: Path) -> set[str]:
    """The modules a file imports anywhere in it (inside functions too), by full name: ``from P
    import N`` counts as P and as P.N (N may be a module); relative imports are resolved."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        found |= names_imported(node, package)
    return found


def names_imported(node: ast.AST, package: tuple[str, ...]) -> set[str]:
    """What one statement of a module in ``package`` imports: ``from P import N`` is P and
    P.N (N may be a module); relative imports resolved. Empty for any other node."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = package[: len(package) - node.level + 1] if node.level else ()
    module = ".".join([*base, *([node.module] if node.module else [])])
    return {module, *(f"{module}.{alias.name}" for alias in node.names)}


def product_modules() -> dict[str, Path]:
    """Every module of the product's packages by full name (a package by its own)."""
    modules = {}
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def test_the_product_imports_no_circle() -> None:
    """No chain of imports leads from a module of the product back to itself, counting imports
    inside functions and under TYPE_CHECKING: each module reads, tests and changes from its
    dependencies up (a type two modules share lives in a third)."""
    modules = product_modules()
    graph = {
        name: {other for other in imported_modules(path) if other in modules and other != name}
        for name, path in modules.items()
    }
    assert circles(graph) == []


def imported_on_import(path: Path, root: Path = REPO) -> set[str]:
    """The modules a file (under ``root``) imports when it is itself imported, by full name: the
    statements at module level (inside ``if`` and ``try`` too), not those in functions or under
    ``TYPE_CHECKING``."""
    package = path.relative_to(root).with_suffix("").parts[:-1]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, (ast.If, ast.Try)):
                visit([*node.body, *node.orelse, *getattr(node, "finalbody", [])])
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            else:
                found.update(names_imported(node, package))

    visit(ast.parse(path.read_text(), str(path)).body)
    return found


def loaded_with(names: set[str], modules: dict[str, Path]) -> set[str]:
    """The product modules that importing ``names`` loads: each with its parent packages and
    what each imports on import, followed to the end."""
    loaded: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in loaded or name not in modules:
            continue
        loaded.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:end]) for end in range(1, len(parts))]
        todo += [other for other in imported_on_import(modules[name]) if other in modules]
    return loaded


def test_the_train_modules_the_submit_path_reads_import_no_torch() -> None:
    """The orchestrator and the Hydra plugins read the trainer's own code for what they must
    agree on (the config, the layout, the model's shape, the planner's inventory), wherever they
    import it (lazily too), on machines that may lack torch and in a launch that must stay
    fast: each of those train modules, and everything it loads in turn, imports no torch."""
    modules = product_modules()
    read = {
        other
        for name, path in modules.items()
        if name.split(".")[0] in ("orchestrator", "hydra_plugins")
        for other in imported_modules(path)
        if other.split(".")[0] == "train" and other in modules
    }
    loaded = loaded_with(read, modules)
    with_torch = {
        name: sorted(m for m in imported_on_import(modules[name]) if m.split(".")[0] == "torch")
        for name in sorted(loaded)
    }
    assert {name: torch for name, torch in with_torch.items() if torch} == {}, sorted(loaded)
    assert {"train.config", "train.parallel.layout", "train.models.inventory"} <= loaded


def test_a_torch_import_on_the_submit_path_is_found(tmp_path: Path) -> None:
    module = tmp_path / "train" / "shape_of_things.py"
    module.parent.mkdir()
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\n"
        "try:\n    import torch.nn\nexcept ImportError:\n    pass\n"
        "def later():\n    import lhotse\n"
    )
    found = {m.split(".")[0] for m in imported_on_import(module, tmp_path)}
    assert "torch" in found and "numpy" not in found and "lhotse" not in found


ARCHITECTURE = REPO / "docs" / "architecture.md"


def test_architecture_md_names_every_module() -> None:
    """docs/architecture.md has a row for every module of the product and for the folders
    around it, so the map a newcomer reads cannot fall behind the code."""
    text = ARCHITECTURE.read_text()
    missing = [
        str(path.relative_to(REPO))
        for path in product_modules().values()
        if path.name != "__init__.py" and f"`{path.relative_to(REPO)}`" not in text
    ]
    folders = ("recipes/", "bench/", "tests/harness/", "templates/")
    missing += [folder for folder in folders if f"| `{folder}` |" not in text]
    assert missing == [], f"docs/architecture.md has no row for: {missing}"


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]


def imported_test_modules(path: Path) -> set[str]:
    """The test modules (``tests.test_*``) and ``tests.conftest`` that a file imports from."""
    under_tests = {".".join(module.split(".")[:2]) for module in imported_modules(path)}
    return {m for m in under_tests if m == "tests.conftest" or m.startswith("tests.test_")}


def harness_modules() -> list[str]:
    """Every module of tests/harness/ (workers and packages included), by full name."""
    names = []
    for path in sorted((TESTS / "harness").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_tests_share_code_only_through_the_harness() -> None:
    """No file under tests/ (test modules, the conftest, the harness) imports a test module or
    the conftest, lazy imports included: what tests share lives in tests/harness/, so a test
    module can change without breaking another."""
    wrong = {}
    for path in sorted(TESTS.rglob("*.py")):
        if bad := imported_test_modules(path):
            wrong[str(path.relative_to(REPO))] = sorted(bad)
    assert wrong == {}, f"imports of a test module or tests.conftest (use tests/harness/): {wrong}"


def test_every_harness_module_imports() -> None:
    """Each module of tests/harness/ imports, in a fresh process as a worker starts: a helper
    moved without its imports fails here, not in the one slow test that reaches it."""
    modules = harness_modules()
    assert {"tests.harness", "tests.harness.process", "tests.harness.workers"} <= set(modules)
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, *modules],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "name",
    ["AWS_ACCESS_KEY", "WANDB_API_KEY", "HF_TOKEN", "dbPassword", "DBPASSWORD", "client_secret"],
)
def test_a_secret_looking_name_is_refused_in_a_recipe_and_dropped_from_logs(name: str) -> None:
    """One rule for both: AWS_ACCESS_KEY used to pass the recipe's check and be scrubbed from
    the logged config by the trainer's."""
    assert looks_secret(name)
    recipe = {"template": "single", "env": {name: "x"}, "command": ["python", "-c", "pass"]}
    with pytest.raises(UsageError, match="looks like a secret"):
        parse_recipe(recipe, Path("r.yaml"))
    assert scrub_secrets({name: "x", "lr": 0.1}, None) == {"lr": 0.1}


@pytest.mark.parametrize("name", ["tokenizer", "tokens_per_s", "max_tokens", "secretary", "SEED"])
def test_harmless_names_are_not_taken_for_secrets(name: str) -> None:
    assert not looks_secret(name)


class StatesInTurn:
    """A backend that reports the given states of one job in turn (the last one then stays):
    SLURM's BOOT_FAIL, DEADLINE or PREEMPTED cannot be made on the loopback cluster."""

    label = "slurm"
    unreachable = None

    def __init__(self, states: list[str], log: Path, lines: list[str]) -> None:
        self.states, self.log, self.lines = states, log, lines

    def statuses(self, job_ids: list[str]) -> dict[str, JobStatus]:
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if self.lines:  # the job writes a line while it runs
            with self.log.open("a") as handle:
                handle.write(self.lines.pop(0))
        return {job_id: JobStatus(job_id, state) for job_id in job_ids}


@pytest.mark.parametrize("end", [*END_STATES])
def test_logs_follow_ends_on_every_terminal_state(tmp_path: Path, end: str) -> None:
    """``orchestrator logs --follow`` streams the whole log and returns when the job ends in
    any terminal state; a requeued job (PENDING again after PREEMPTED) and a COMPLETING one are
    still followed."""
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "r-7.out"
    manifest = Manifest(
        "c", "r.sub", "", "", str(tmp_path), "slurm", "afterany", 1, [], None, None, None, 0.0
    )
    job = JobRecord(index=0, seed=1, job_id="7")
    states = ["RUNNING", "PREEMPTED", "REQUEUED", "PENDING", "RUNNING", *ENDING_STATES, end]
    lines = [f"line {index}\n" for index in range(len(states) - 1)]
    backend = StatesInTurn(states, log, list(lines))
    out = io.StringIO()
    with redirect_stdout(out):
        follow(manifest, job, backend, 0.0, 0.2, look_every_s=0.0)  # type: ignore[arg-type]
    assert out.getvalue() == "".join(lines)
    assert has_ended(end) and not has_ended("COMPLETING") and not has_ended("REQUEUED")


class CountedLooks:
    """A backend that counts the looks taken: RUNNING until ``done`` is set, then COMPLETED."""

    label = "slurm"
    unreachable = None

    def __init__(self, done: threading.Event) -> None:
        self.done, self.looks = done, 0

    def statuses(self, job_ids: list[str]) -> dict[str, JobStatus]:
        self.looks += 1
        state = "COMPLETED" if self.done.is_set() else "RUNNING"
        return {job_id: JobStatus(job_id, state) for job_id in job_ids}


def test_logs_follow_asks_the_scheduler_once_a_look_however_fast_the_log_grows(tmp_path: Path):
    """A job that writes a line every few milliseconds: every line is streamed, yet the
    scheduler (a few RPCs a look) is asked at most once per ``look_every_s``, not once a read
    as before (~100 looks here)."""
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "r-7.out"
    log.touch()
    manifest = Manifest(
        "c", "r.sub", "", "", str(tmp_path), "slurm", "afterany", 1, [], None, None, None, 0.0
    )
    done = threading.Event()
    lines = [f"line {index}\n" for index in range(100)]

    def write() -> None:
        for line in lines:
            with log.open("a") as handle:
                handle.write(line)
            time.sleep(0.005)
        done.set()

    writer = threading.Thread(target=write)
    backend = CountedLooks(done)
    out = io.StringIO()
    started = time.monotonic()
    writer.start()
    with redirect_stdout(out):
        follow(manifest, JobRecord(index=0, seed=1, job_id="7"), backend, 0.01, 0.2, 0.1)  # type: ignore[arg-type]
    took = time.monotonic() - started
    writer.join()
    assert out.getvalue() == "".join(lines)
    assert 2 <= backend.looks <= took / 0.1 + 1, (backend.looks, took)


def test_scripts_carry_the_contract_numbers() -> None:
    """The batch templates get the port rule, the hook's exit code and the outcome line from
    contract/, not copies of their own."""
    spec = parse_recipe(
        {"template": "distributed", "nodes": 2, "command": ["python", "-c", "pass"]},
        Path("r.yaml"),
    )
    script = render_recipe(spec)
    assert f"$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))" in script
    assert f"if [[ $orch_hook_status -eq {EXIT_CHAIN_ENDED} ]]; then exit 0; fi" in script
    assert f'echo "{EXITED_PREFIX} ${{orch_status}}"' in script


RANK_SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} argv {sys.argv[1:]}", flush=True)
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(7)
time.sleep(120)
"""


def test_the_zygote_ends_ranks_as_torchrun_does(tmp_path: Path) -> None:
    """The tests' rank launcher (harness/process.run_python): a failed rank's code is the
    command's and its peer is stopped at once; a command past its timeout is killed, and the
    next command still runs (its answers are not read as the next one's)."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ)
    # Within torchrun's 30 s before the SIGKILL that follows an unheeded SIGTERM: SIGTERM did it.
    failed = run_python([str(script), "fail"], 2, env, timeout=20)
    assert failed.returncode == 7, failed.stderr
    assert sorted(failed.stdout.splitlines()) == [f"rank {r} of 2 argv ['fail']" for r in (0, 1)]
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([str(script), "sleep"], 2, env, timeout=3)
    again = run_python([str(script), "fail"], 2, env, timeout=20)
    assert again.returncode == 7, again.stderr


def test_the_zygote_serves_a_command_unless_it_would_import_differently() -> None:
    """A variable torch sets in the test process after the zygote started (inductor's cache
    folder, once a test compiled in-process) must not send later commands to fresh
    interpreters, whose torchrun answers a failed rank with its own exit code 1; one read at
    import (a torch or Python setting) must."""
    started = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert imports_alike(started, {**started, "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"})
    assert imports_alike(started, {**started, "SLURM_JOB_ID": "77"})
    assert not imports_alike(started, {**started, "TORCH_LOGS": "recompiles"})
    assert not imports_alike(started, {**started, "OMP_NUM_THREADS": "2"})
