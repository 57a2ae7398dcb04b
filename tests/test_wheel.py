"""The toolkit as a user installs it: a wheel, in a fresh environment, used outside the checkout.

The wheel is built from a copy of the working tree and installed with ``--no-deps`` into a new
virtual environment that sees the project environment's packages (torch, hydra, submitit...)
through a path file, but not the checkout: every command runs from an empty directory, so the
templates, Hydra configs and recipes can only come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow

OFFLINE = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def run(argv: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> str:
    completed = subprocess.run(
        [str(word) for word in argv],
        cwd=cwd,
        env={**os.environ, **OFFLINE} if env is None else env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, f"{argv}:\n{completed.stdout}\n{completed.stderr}"
    return completed.stdout


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin folder of a fresh environment holding the wheel and no other project file."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    files = run(["git", "ls-files", "-z", "-co", "--exclude-standard"], REPO).split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         root / "dist", source], root)  # fmt: skip
    [wheel] = (root / "dist").glob("*.whl")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], root)
    python = venv / "bin" / "python"
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root)
    # A plain path line: the project environment's own .pth files (the editable install of the
    # checkout among them) are not read, so only its third-party packages are seen.
    Path(site.strip(), "project_packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", wheel], root)
    return venv / "bin"


def user_env(venv_bin: Path, home: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "SLURM_CONF"}
    env.update(PATH=f"{venv_bin}{os.pathsep}{env['PATH']}", ORCH_HOME=str(home))
    return {**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **OFFLINE}


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

    # A YAML recipe copied here renders with the packaged distributed template.
    shutil.copy(shipped / "train_tiny_fsdp2.yaml", here / "mine.yaml")
    dry = run([venv_bin / "auto_launch", "--dry-run", "--backend", "local", "mine.yaml"], here, env)
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
