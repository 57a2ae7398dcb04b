"""The toolkit as a user installs it: a wheel, in a fresh environment, used outside the checkout.

The wheel is built from a copy of the working tree. A new virtual environment gets torch the
way ``make setup`` installs it (``make setup-torch``), then the wheel with the dependencies that
pyproject.toml declares, resolved by pip with no network from the wheelhouse ``make setup``
keeps: a dependency missing from pyproject fails ``pip check``, an import or a command here.
Every command runs from an empty directory, so the templates, Hydra configs and recipes can only
come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.harness.process import REPO
from tests.harness.wheel import OFFLINE, build_wheel, run, wheelhouse

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin folder of a fresh environment holding torch, the wheel and its dependencies, and
    no other project file."""
    root = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(root)
    # Offline; no byte-compiling of torch's thousands of files (what is imported compiles then).
    offline = ["--no-index", "--find-links", str(wheelhouse()), "--no-compile"]
    venv = root / "venv"
    run(["make", "-s", "-C", REPO, f"VENV={venv}", f"PIP_OPTIONS={' '.join(offline)}",
         "setup-torch"], root)  # fmt: skip
    run([venv / "bin" / "python", "-m", "pip", "install", "-q", *offline, wheel], root)
    return venv / "bin"


def user_env(venv_bin: Path, home: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "SLURM_CONF"}
    env.update(PATH=f"{venv_bin}{os.pathsep}{env['PATH']}", ORCH_HOME=str(home))
    return {**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **OFFLINE}


# Imports every module the wheel ships (but __main__, which would run): one whose dependency
# pyproject does not declare fails here, wherever a command would first meet it.
IMPORT_ALL = """
import importlib, importlib.metadata as metadata
[ours] = metadata.packages_distributions()["orchestrator"]
for file in metadata.distribution(ours).files:
    if file.suffix == ".py" and file.name != "__main__.py":
        importlib.import_module(".".join(file.with_suffix("").parts).removesuffix(".__init__"))
"""


def test_the_wheel_brings_the_dependencies_it_imports(venv_bin: Path, tmp_path: Path) -> None:
    env = user_env(venv_bin, tmp_path / "home")
    run([venv_bin / "python", "-m", "pip", "check"], tmp_path, env)
    run([venv_bin / "python", "-c", IMPORT_ALL], tmp_path, env)


def test_the_installed_wheel_works_from_an_empty_directory(
    venv_bin: Path, tmp_path: Path, corpus: Path
) -> None:
    here = tmp_path / "empty"
    here.mkdir()
    env = user_env(venv_bin, tmp_path / "home")
    python = venv_bin / "python"
    where = run(
        [python, "-c", "import orchestrator, recipes; print(recipes.__path__[0])"], here, env
    )
    shipped = Path(where.strip())
    assert not shipped.is_relative_to(REPO), shipped
    version = run([venv_bin / "orchestrator", "--version"], here, env)
    assert version.split() == [
        "orchestrator",
        run(
            [python, "-c", "import orchestrator; print(orchestrator.__version__)"], here, env
        ).strip(),
    ]

    # The planner's table of measured runs ships with it, priced within its bounds.
    measured = run([venv_bin / "orchestrator", "plan", "--measured"], here, env)
    assert "0 figure(s) outside the bounds" in measured

    # A YAML recipe copied here renders with the packaged distributed template.
    shutil.copy(shipped / "train_tiny_fsdp2.yaml", here / "mine.yaml")
    dry = run(
        [venv_bin / "auto_launch", "--dry-run", "--backend", "local", "mine.yaml", "--",
         f"data.corpus={corpus}"],
        here,
        env,
    )  # fmt: skip
    assert "#SBATCH --nodes=1" in dry and "torchrun" in dry

    # The shipped smoke recipe, found by its name, runs a 2-job chain on this machine.
    launched = run(
        [venv_bin / "auto_launch", "-n2", "--backend", "local", "--json", "smoke.yaml",
         "--", "--steps", "2", "--sleep", "0.1"],
        here,
        env,
    )  # fmt: skip
    chain = json.loads(launched.strip().splitlines()[-1])
    assert [job["state"] for job in chain["jobs"]] == ["COMPLETED", "COMPLETED"]

    # The trainer with the packaged default config and an explicit corpus, one step.
    run_dir = tmp_path / "train"
    run(
        [python, "-m", "train", f"data.corpus={corpus}", "train.max_steps=1",
         f"run_dir={run_dir}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        here,
        env,
    )  # fmt: skip
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-1] == 1
    assert sorted(path.name for path in here.iterdir()) == ["mine.yaml"]
