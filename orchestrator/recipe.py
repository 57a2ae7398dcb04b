"""A YAML recipe: the few facts a batch script needs, validated before anything is rendered.

A recipe is a mapping with these keys (any other key is an error):

``template``        ``single`` (default): one process on one node, started by the batch shell
                    itself (through ``srun`` only when a container is set); ``distributed``: an
                    ``srun`` step across ``nodes`` nodes, started by ``launcher``.
``nodes``           nodes to allocate (default 1; ``single`` needs 1).
``tasks_per_node``  processes (ranks) per node (default 1; ``single`` needs 1). For GPU training
                    set it to ``gpus_per_node``: one rank per GPU.
``gpus_per_node``   GPUs per node, rendered as ``--gres=gpu:N`` (default 0: none asked).
``cpus_per_task``   CPUs per rank (default 1).
``time``            the time limit in SLURM's format: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S
                    (default ``"00:30:00"``). A chain's jobs need a limit, so UNLIMITED is refused.
``partition``, ``account``, ``qos``   optional; rendered only when given.
``signal_grace``    seconds before the time limit at which SLURM sends USR1 to the batch shell,
                    which forwards it so the training can save and exit 0 (default 120; must be
                    more than 0, less than the time limit and at most 65535).
``launcher``        ``distributed`` only: ``torchrun`` (default; one task per node running
                    torchrun with a c10d rendezvous on the first node) or ``srun`` (one task per
                    rank, RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT exported from SLURM's
                    variables).
``container``       optional ``{image: ..., mounts: [src:dst, ...]}``, rendered as pyxis's
                    ``srun --container-image`` / ``--container-mounts``.
``env``             optional mapping NAME -> value exported before the training starts. Names
                    must be shell identifiers; names that look like secrets (``*_API_KEY``,
                    ``*_TOKEN``, ``*PASSWORD*``, ``*SECRET*``) are refused, since secrets come from
                    the environment at run time, never from a file in the repository; names the
                    orchestrator, SLURM or the launcher set are refused too. Values are exported
                    by the batch shell, so ``${SLURM_NODEID}`` is refused there (it would be the
                    first node's on every node).
``command``         required: the argv of ONE training process, as a list of words, e.g.
                    ``[python, -m, train, --seed, "${SEED}"]``; the torchrun launcher runs it with
                    ``torchrun --no-python``. Arguments given to the script after the seed
                    (``auto_launch recipe.yaml -- ARGS``) are appended to it.

Command words and env values are passed literally (shell-quoted), except for references to the
contract variables in ``CONTRACT_VARIABLES`` written as ``${NAME}``, which expand when the job
runs (``seed=${SEED}`` gives ``seed=1234``). Any other ``${NAME}`` or ``$NAME`` is an error rather
than literal text, because it almost always means a variable the author expected to expand; other
``$`` text (``$(...)``, ``$1``, a trailing ``$``) stays literal. YAML's base-60 numbers are off, so
``time: 1:30:00`` reads as the string it looks like.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import UsageError
from orchestrator.slurm_time import parse_time_minutes

TEMPLATES = ("single", "distributed")
LAUNCHERS = ("torchrun", "srun")
CONTRACT_VARIABLES = (
    "SEED",
    "ORCH_CHAIN_ID",
    "ORCH_JOB_INDEX",
    "ORCH_NUM_JOBS",
    "ORCH_SEED",
    "ORCH_RUN_DIR",
    "SLURM_JOB_ID",
    "SLURM_NODEID",
)
FIELDS = (
    "template",
    "nodes",
    "tasks_per_node",
    "gpus_per_node",
    "cpus_per_task",
    "time",
    "partition",
    "account",
    "qos",
    "signal_grace",
    "launcher",
    "container",
    "env",
    "command",
)
CONTAINER_FIELDS = ("image", "mounts")
MAX_SIGNAL_GRACE = 65535  # sbatch's limit for the @time of --signal

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_NAME = re.compile(r"(^|_)API_KEY$|(^|_)TOKEN$|PASSWORD|SECRET")
_RESERVED_NAME = re.compile(
    r"^(SEED|ORCH_\w+|SLURM_\w+|MASTER_ADDR|MASTER_PORT|RANK|WORLD_SIZE|LOCAL_RANK"
    r"|LOCAL_WORLD_SIZE)$"
)
# partition/account/qos land in #SBATCH comment lines, where quoting cannot contain a newline.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,+@-]+$")
_VARIABLE_REFERENCE = re.compile(r"\$\{([^}]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")

# Builds the UsageError for (field, problem), naming the recipe file.
_Fail = Callable[[str, str], UsageError]


@dataclass(frozen=True)
class Container:
    image: str
    mounts: tuple[str, ...] = ()


@dataclass(frozen=True)
class RecipeSpec:
    source: Path
    command: tuple[str, ...]
    template: str = "single"
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    time: str = "00:30:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    signal_grace: int = 120
    launcher: str = "torchrun"
    container: Container | None = None
    env: dict[str, str] = field(default_factory=dict)

    def container_flags(self) -> list[str]:
        """pyxis's srun options for the container; none without one."""
        if self.container is None:
            return []
        flags = [f"--container-image={self.container.image}"]
        if self.container.mounts:
            flags.append(f"--container-mounts={','.join(self.container.mounts)}")
        return flags


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's base-60 numbers: ``1:30:00`` stays a string, not 5400."""

    def resolve(self, kind: type, value: str, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and implicit[0] and ":" in value:
            return "tag:yaml.org,2002:str"
        return super().resolve(kind, value, implicit)


def load_recipe(path: Path | str) -> RecipeSpec:
    """Read and validate a YAML recipe; any problem is a UsageError naming the file and field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise UsageError(f"recipe {path}: cannot read it ({error.strerror})") from error
    except UnicodeDecodeError as error:
        raise UsageError(f"recipe {path}: not a text file ({error.reason})") from error
    try:
        raw = yaml.load(text, Loader=_RecipeLoader)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise UsageError(f"recipe {path}: not valid YAML{line}: {problem}") from error
    return parse_recipe(raw, path)


def parse_recipe(raw: Any, source: Path) -> RecipeSpec:
    """Validate an already-parsed recipe mapping (``source`` only names it in messages)."""

    def fail(key: str, problem: str) -> UsageError:
        return UsageError(f"recipe {source}: {key}: {problem}")

    if not isinstance(raw, dict):
        raise UsageError(
            f"recipe {source}: the file must hold a mapping of fields "
            f"({', '.join(FIELDS)}), not {type(raw).__name__}"
        )
    for key in raw:
        if key not in FIELDS:
            raise fail(str(key), f"unknown field; the fields are {', '.join(FIELDS)}")
    if "command" not in raw:
        raise fail("command", "missing; give the training's argv as a list of words")

    template = _choice(raw, "template", TEMPLATES, "single", fail)
    nodes = _integer(raw, "nodes", 1, 1, fail)
    tasks_per_node = _integer(raw, "tasks_per_node", 1, 1, fail)
    if template == "single":
        if nodes != 1 or tasks_per_node != 1:
            key = "nodes" if nodes != 1 else "tasks_per_node"
            raise fail(key, "template single runs one process on one node; use distributed")
        if "launcher" in raw:
            raise fail("launcher", "only template distributed has a launcher")
    time = _time(raw, fail)
    signal_grace = _integer(raw, "signal_grace", 120, 1, fail)
    limit_seconds = parse_time_minutes(time) * 60  # _time refused UNLIMITED
    if signal_grace >= limit_seconds or signal_grace > MAX_SIGNAL_GRACE:
        raise fail(
            "signal_grace",
            f"{signal_grace} s must be less than the time limit ({time}) and at most "
            f"{MAX_SIGNAL_GRACE} s",
        )
    return RecipeSpec(
        source=source,
        command=_command(raw["command"], fail),
        template=template,
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        gpus_per_node=_integer(raw, "gpus_per_node", 0, 0, fail),
        cpus_per_task=_integer(raw, "cpus_per_task", 1, 1, fail),
        time=time,
        partition=_slurm_name(raw, "partition", fail),
        account=_slurm_name(raw, "account", fail),
        qos=_slurm_name(raw, "qos", fail),
        signal_grace=signal_grace,
        launcher=_choice(raw, "launcher", LAUNCHERS, "torchrun", fail),
        container=_container(raw.get("container"), fail),
        env=_env(raw.get("env"), fail),
    )


def _check_word(word: str, key: str, fail: _Fail) -> None:
    """Refuse variable references other than ``${CONTRACT_VARIABLE}`` (see the module docstring)."""
    if "\0" in word:
        raise fail(key, "holds a NUL byte, which no shell can pass")
    for match in _VARIABLE_REFERENCE.finditer(word):
        braced, bare = match.groups()
        if braced in CONTRACT_VARIABLES:
            continue
        if bare in CONTRACT_VARIABLES:
            raise fail(key, f"{word!r}: write ${{{bare}}} (with braces) to expand {bare}")
        allowed = ", ".join(f"${{{name}}}" for name in CONTRACT_VARIABLES)
        raise fail(
            key,
            f"{word!r} refers to {match.group(0)}, which a recipe does not expand; only {allowed}"
            " do. Write the value itself",
        )


def _choice(raw: dict, key: str, choices: tuple[str, ...], default: str, fail: _Fail) -> str:
    value = raw.get(key, default)
    if value not in choices:
        raise fail(key, f"{value!r} is not one of {', '.join(choices)}")
    return value


def _integer(raw: dict, key: str, default: int, minimum: int, fail: _Fail) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(key, f"{value!r} is not a whole number")
    if value < minimum:
        raise fail(key, f"{value} is less than {minimum}")
    return value


def _time(raw: dict, fail: _Fail) -> str:
    value = raw.get("time", "00:30:00")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise fail("time", f"{value!r} is not a SLURM time limit such as 30 or 02:00:00")
    text = str(value).strip()
    try:
        minutes = parse_time_minutes(text)
    except UsageError as error:
        raise fail("time", str(error)) from error
    if minutes is None or minutes <= 0:
        raise fail("time", f"{text!r}: a chain's jobs need a time limit above zero")
    return text


def _slurm_name(raw: dict, key: str, fail: _Fail) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not _SLURM_NAME.match(value):
        raise fail(key, f"{value!r}: use letters, digits and _ . , + @ - only")
    return value


def _scalar_text(value: Any, key: str, fail: _Fail) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise fail(key, f"{value!r} is not a string or number; quote it in the YAML")
    return str(value)


def _command(value: Any, fail: _Fail) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise fail("command", "give the training's argv as a non-empty list of words")
    words = []
    for position, item in enumerate(value):
        key = f"command[{position}]"
        word = _scalar_text(item, key, fail)
        _check_word(word, key, fail)
        words.append(word)
    return tuple(words)


def _container(value: Any, fail: _Fail) -> Container | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise fail("container", "give a mapping {image: ..., mounts: [...]}")
    for key in value:
        if key not in CONTAINER_FIELDS:
            raise fail(f"container.{key}", "unknown field; the fields are image, mounts")
    image = value.get("image")
    if not isinstance(image, str) or not image.strip():
        raise fail(
            "container.image", "missing; name the image, e.g. nvcr.io#nvidia/pytorch:24.09-py3"
        )
    mounts = value.get("mounts", [])
    if not isinstance(mounts, list):
        raise fail("container.mounts", "give a list of SRC:DST[:FLAGS] strings")
    for position, mount in enumerate(mounts):
        if not isinstance(mount, str) or not mount or "," in mount:
            raise fail(f"container.mounts[{position}]", f"{mount!r} is not SRC:DST[:FLAGS]")
    return Container(image=image, mounts=tuple(mounts))


def _env(value: Any, fail: _Fail) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail("env", "give a mapping NAME: value")
    env = {}
    for name, item in value.items():
        key = f"env.{name}"
        if not isinstance(name, str) or not _IDENTIFIER.match(name):
            raise fail(key, "not a shell variable name (letters, digits and _, not first a digit)")
        if _SECRET_NAME.search(name.upper()):
            raise fail(
                key,
                "looks like a secret; secrets come from the environment at run time "
                "(export it before auto_launch), never from a recipe file",
            )
        if _RESERVED_NAME.match(name):
            raise fail(key, "is set by the orchestrator, SLURM or the launcher; pick another name")
        text = _scalar_text(item, key, fail)
        _check_word(text, key, fail)
        if "${SLURM_NODEID}" in text:
            raise fail(
                key,
                "env values expand in the batch shell, on the first node, so ${SLURM_NODEID} "
                "would be 0 for every node; use it in the command or read it in the program",
            )
        env[name] = text
    return env
