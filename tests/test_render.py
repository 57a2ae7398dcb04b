"""YAML recipes and their rendered batch scripts: golden files, quoting run through real bash,
validation errors, and the .sub contract checks. Fast: no SLURM.

Regenerate the golden files after an intended template change with
``UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_render.py`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.job_env import port_for
from orchestrator.errors import UsageError
from orchestrator.recipe import load_recipe
from orchestrator.render import render_recipe, shell_word
from orchestrator.scripts import prepare_script
from orchestrator.slurm.directives import parse_sbatch_directives
from orchestrator.slurm.resources import JobResources
from orchestrator.slurm.time_limit import parse_time_minutes
from tests.harness.process import REPO

GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(autouse=True)
def repo_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCH_TEMPLATE_DIR", raising=False)


def write_recipe(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def run_script(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.update(ORCH_RUN_DIR=str(cwd), ORCH_JOB_INDEX="0", ORCH_NUM_JOBS="1", ORCH_SEED="42")
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=60
    )


# ---- golden files ----


@pytest.mark.parametrize("name", ["smoke", "smoke_2node", "gpu_8x"])
def test_rendered_recipe_matches_golden_file(name: str) -> None:
    text = prepare_script(REPO / "recipes" / f"{name}.yaml").text
    golden = GOLDEN / f"{name}.sub"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"rendering changed; see the module docstring for {golden}"
    subprocess.run(["bash", "-n", str(golden)], check=True)


@pytest.mark.parametrize("job_id", ["1", "18818", "32767", "123456789"])
def test_the_rendezvous_port_is_one_rule_below_the_ephemeral_ports(job_id: str) -> None:
    """The batch script and the srun/submitit members (train.parallel.launch_env) pick the same
    port, and never one in Linux's ephemeral range: in a CI run, a port there was held by an
    outgoing socket
    of the job before, and neither node's torchrun could host the rendezvous."""
    text = prepare_script(REPO / "recipes" / "smoke_2node.yaml").text
    (line,) = [line for line in text.splitlines() if line.startswith("export MASTER_PORT=")]
    shell = f"SLURM_JOB_ID={job_id}; {line}; echo $MASTER_PORT"
    port = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
    assert port.stdout.strip() == port_for(job_id)
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    assert 1024 < int(port_for(job_id)) < min(int(ephemeral[0]), 32768)


def test_prepared_yaml_has_directives_and_resources() -> None:
    prepared = prepare_script(REPO / "recipes" / "gpu_8x.yaml")
    assert prepared.source_kind == "yaml"
    directives = parse_sbatch_directives(prepared.text)
    assert directives["nodes"] == "2"
    assert directives["gres"] == "gpu:8"
    assert directives["signal"] == "B:USR1@300"
    assert directives["open-mode"] == "append"
    assert (prepared.resources.nodes, prepared.resources.gpus_per_node) == (2, 8)
    spec = prepared.spec
    assert (spec.nodes, spec.tasks_per_node, spec.gpus_per_node) == (2, 8, 8)
    assert (spec.cpus_per_task, spec.time) == (12, "04:00:00")
    assert spec.partition == "gpu"


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_typed_resources_are_what_the_rendered_script_asks_for(recipe: Path) -> None:
    """The launch checks read a YAML recipe's settings, sbatch reads the rendered #SBATCH lines:
    both must ask for the same machines."""
    prepared = prepare_script(recipe)
    read_back = JobResources.from_directives(parse_sbatch_directives(prepared.text))
    assert prepared.resources == dataclasses.replace(read_back, gpu=prepared.resources.gpu)


def test_unquoted_clock_time_is_not_read_as_base_60(tmp_path: Path) -> None:
    spec = load_recipe(write_recipe(tmp_path, "time: 1:30:00\ncommand: [python]\n"))
    assert spec.time == "1:30:00"
    assert parse_time_minutes(spec.time) == 90


def test_container_renders_pyxis_flags(tmp_path: Path) -> None:
    body = (
        "container:\n  image: nvcr.io#nvidia/pytorch:24.09-py3\n  mounts: [/data:/data, /x:/y:ro]\n"
        "command: [python, train.py]\n"
    )
    single = render_recipe(load_recipe(write_recipe(tmp_path, body)))
    distributed = render_recipe(
        load_recipe(write_recipe(tmp_path, f"template: distributed\nnodes: 2\n{body}"))
    )
    flags = (
        "'--container-image=nvcr.io#nvidia/pytorch:24.09-py3'"
        " --container-mounts=/data:/data,/x:/y:ro"
    )
    for text in (single, distributed):
        assert flags in text
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    assert f"srun --ntasks=1 --cpus-per-task=1 {flags}" in single


def test_srun_launcher_exports_ranks_from_slurm(tmp_path: Path) -> None:
    text = render_recipe(
        load_recipe(
            write_recipe(
                tmp_path,
                "template: distributed\nlauncher: srun\nnodes: 2\ntasks_per_node: 4\n"
                "command: [python, train.py]\n",
            )
        )
    )
    assert "export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID" in text
    assert "srun --ntasks-per-node=4 --cpus-per-task=1" in text
    assert "torchrun" not in text


# ---- template machinery ----


def test_missing_template_variable_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "single.sub.j2").write_text(
        "#!/bin/bash\n#SBATCH --nodes={{ recipe.nodes }}\n{{ nodez }}\n"
    )
    monkeypatch.setenv("ORCH_TEMPLATE_DIR", str(tmp_path))
    spec = load_recipe(REPO / "recipes" / "smoke.yaml")
    with pytest.raises(UsageError, match="nodez"):
        render_recipe(spec)


def test_shell_word_expands_only_contract_references() -> None:
    assert shell_word("seed=${SEED}") == 'seed="${SEED}"'
    assert shell_word("${ORCH_RUN_DIR}/ckpt dir") == "\"${ORCH_RUN_DIR}\"'/ckpt dir'"
    assert shell_word("") == "''"
    assert shell_word("$(id)") == "'$(id)'"


def test_hostile_words_and_env_values_stay_literal(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hostile = [
        f"$(touch {marker})",
        f"`touch {marker}`",
        f'"; touch {marker}; echo "',
        f"'; touch {marker}; '",
        f"line one\ntouch {marker}",
        "$((6*7)) * ~ ! #not-a-comment \\ ''",
        "",
    ]
    show = (
        "import json, os, sys; "
        "print(json.dumps({'argv': sys.argv[1:], "
        "'env': [os.environ[f'HOSTILE_{i}'] for i in range(7)], 'run': os.environ['RUN']}))"
    )
    recipe = {
        "time": 5,
        "env": {
            **{f"HOSTILE_{i}": value for i, value in enumerate(hostile)},
            "RUN": "${ORCH_RUN_DIR}/runs",
        },
        "command": ["python", "-c", show, *hostile, "seed=${SEED}", "index ${ORCH_JOB_INDEX}"],
    }
    script = tmp_path / "job.sub"
    script.write_text(render_recipe(load_recipe(write_recipe(tmp_path, json.dumps(recipe)))))

    extra = [f"$(touch {marker})", "two words"]
    completed = run_script(script, "42", *extra, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    shown = json.loads(next(line for line in completed.stdout.splitlines() if line.startswith("{")))
    assert shown["argv"] == [*hostile, "seed=42", "index 0", *extra]
    assert shown["env"] == hostile
    assert shown["run"] == f"{tmp_path}/runs"
    assert not marker.exists()


@pytest.mark.parametrize(
    ("user_value", "seen"),
    [(None, "expandable_segments:True"), ("max_split_size_mb:512", "max_split_size_mb:512")],
)
def test_rendered_script_sets_the_cuda_allocator_unless_the_user_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user_value: str | None, seen: str
) -> None:
    recipe = {
        "time": 5,
        "command": ["python", "-c", "import os; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"],
    }
    script = tmp_path / "job.sub"
    script.write_text(render_recipe(load_recipe(write_recipe(tmp_path, json.dumps(recipe)))))
    if user_value is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user_value)
    completed = run_script(script, "42", cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert seen in completed.stdout.splitlines()


@pytest.mark.parametrize("args", [[], ["abc"]])
def test_rendered_script_refuses_to_run_without_a_seed(tmp_path: Path, args: list[str]) -> None:
    script = tmp_path / "smoke.sub"
    script.write_text(prepare_script(REPO / "recipes" / "smoke.yaml").text)
    completed = run_script(script, *args, cwd=tmp_path)
    assert completed.returncode == 2
    assert "seed" in completed.stderr
    assert "smoke" not in completed.stdout  # nothing ran


# ---- validation ----

BAD_RECIPES = [
    ("comand: [python]\n", "comand: unknown field"),
    ("nodes: 1\n", "command: missing"),
    ("command: python train.py\n", "command: give"),
    ("command: []\n", "command: give"),
    ("command: [python, {a: 1}]\n", "command[1]"),
    ("command: [python, '${HOME}/x']\n", "command[1]: '${HOME}/x' refers to ${HOME}"),
    ("command: [python, '$SEED']\n", "write ${SEED}"),
    ("time: '1:2:3:4'\ncommand: [x]\n", "time:"),
    ("time: UNLIMITED\ncommand: [x]\n", "time:"),
    ("template: distributed\nnodes: 0\ncommand: [x]\n", "nodes: 0 is less than 1"),
    ("nodes: true\ncommand: [x]\n", "nodes: True is not a whole number"),
    ("nodes: 2\ncommand: [x]\n", "nodes: template single runs one process"),
    ("gpus_per_node: -1\ncommand: [x]\n", "gpus_per_node: -1 is less than 0"),
    ("time: 1\nsignal_grace: 60\ncommand: [x]\n", "signal_grace: 60 s must be less"),
    ("signal_grace: 0\ncommand: [x]\n", "signal_grace: 0 is less than 1"),
    ("template: multi\ncommand: [x]\n", "template: 'multi' is not one of"),
    ("template: distributed\nlauncher: mpirun\ncommand: [x]\n", "launcher: 'mpirun'"),
    ("launcher: srun\ncommand: [x]\n", "launcher: only template distributed"),
    ("partition: 'gpu\nrm -rf ~'\ncommand: [x]\n", "partition:"),
    ("env: {WANDB_API_KEY: abc}\ncommand: [x]\n", "env.WANDB_API_KEY: looks like a secret"),
    ("env: {HF_TOKEN: abc}\ncommand: [x]\n", "env.HF_TOKEN: looks like a secret"),
    ("env: {DB_PASSWORD_FILE: abc}\ncommand: [x]\n", "env.DB_PASSWORD_FILE: looks like a secret"),
    ("env: {client_secret: abc}\ncommand: [x]\n", "env.client_secret: looks like a secret"),
    ("env: {1BAD: x}\ncommand: [x]\n", "env.1BAD: not a shell variable name"),
    ("env: {ORCH_SEED: 1}\ncommand: [x]\n", "env.ORCH_SEED: is set by"),
    ("env: {DEBUG: yes}\ncommand: [x]\n", "env.DEBUG: True is not a string"),
    ("env: {WHERE: 'n${SLURM_NODEID}'}\ncommand: [x]\n", "env.WHERE: env values expand"),
    ("container: {mounts: [/a:/b]}\ncommand: [x]\n", "container.image: missing"),
    ("container: {image: x, workdir: /}\ncommand: [x]\n", "container.workdir: unknown field"),
    ("command: [x\n", "not valid YAML at line"),
    ("- command\n", "must hold a mapping"),
    ("", "must hold a mapping"),
]


@pytest.mark.parametrize(("text", "message"), BAD_RECIPES)
def test_bad_recipe_is_a_usage_error_naming_the_field(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write_recipe(tmp_path, text)
    with pytest.raises(UsageError) as caught:
        prepare_script(path)
    assert str(path) in str(caught.value)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


# ---- .sub scripts ----


def test_hand_written_sub_passes_through() -> None:
    path = REPO / "recipes" / "smoke.sub"
    prepared = prepare_script(path)
    assert prepared.source_kind == "sub"
    assert prepared.text == path.read_text()
    assert parse_sbatch_directives(prepared.text)["signal"] == "B:USR1@60"
    assert prepared.spec is None


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("job.sub", "#SBATCH --time=5\nSEED=$1\n", "must be a #! line"),
        ("job.sub", "#!/bin/bash\n#SBATCH --time=5\n# takes SEED=$1\necho hi\n", "never reads $1"),
        ("job.sh", "#!/bin/bash\necho ${10}\n", "never reads $1"),
        ("job.txt", "#!/bin/bash\nSEED=$1\n", "use .yaml, .yml, .sub, .sh"),
        ("job.yaml", None, "cannot read it"),
    ],
)
def test_bad_script_is_refused(tmp_path: Path, name: str, text: str | None, message: str) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError, match=message.replace("$", r"\$").replace(".", r"\.")):
        prepare_script(path)


@pytest.mark.parametrize("line", ["SEED=$1", 'SEED="${1:?give a seed}"', "run --seed $1"])
def test_sub_reading_its_first_argument_is_accepted(tmp_path: Path, line: str) -> None:
    path = tmp_path / "job.sub"
    path.write_text(f"#!/bin/bash\n#SBATCH --nodes=1\n{line}\n")
    assert parse_sbatch_directives(prepare_script(path).text) == {"nodes": "1"}
