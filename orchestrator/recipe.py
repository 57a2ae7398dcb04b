"""A YAML recipe: the few facts a batch script needs, in one typed schema.

``RecipeSettings`` is the one definition of a recipe's fields, their types and defaults: YAML
recipes (``Recipe``, the settings plus ``command``), the chained Hydra launcher (its config is
generated from the settings, see ``plain_fields``) and the renderer all use it. pydantic checks
types, ranges, choices and unknown fields; what remains as code are the project's own rules:
secrets refused, references only to the contract variables, the single template on one process,
the signal grace below the time limit. Every problem is one line naming the file and the field.

The fields (any other key is an error):

``template``        ``single`` (default): one process on one node, started by the batch shell
                    itself (through ``srun`` only when a container is set); ``distributed``: an
                    ``srun`` step across ``nodes`` nodes, started by ``launcher``.
``nodes``           nodes the training runs on (default 1; ``single`` needs 1).
``spare_nodes``     ``distributed`` only: nodes allocated besides (default 0). The training's
                    step runs on ``nodes`` of them; when the trainer names a rank slow
                    (``train.straggler``) while a spare is free, it saves and stops, and the
                    chain hook launches it again in the same job off that node (docs/faults.md).
``tasks_per_node``  processes (ranks) per node (default 1; ``single`` needs 1). For GPU training
                    set it to ``gpus_per_node``: one rank per GPU.
``gpus_per_node``   GPUs per node, rendered as ``--gres=gpu:N`` (default 0: none asked).
``gpu``             optional: the GPU model (``h100``, ``h200``, ``a100``, ``b200``, ...; see
                    ``orchestrator plan --help``). Not rendered: the plan check prices the
                    training layout against this GPU's memory (else the partition's GPU type
                    from sinfo).
``cpus_per_task``   CPUs per rank (default 1).
``time``            the time limit in SLURM's format: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S
                    (default ``"00:30:00"``). A chain's jobs need a limit, so UNLIMITED is refused.
``partition``, ``account``, ``qos``   optional; rendered only when given.
``signal_grace``    seconds before the time limit at which SLURM sends USR1 to the batch shell,
                    which forwards it so the training can save and exit 0 (default 120; must be
                    more than 0, less than the time limit and at most 65535).
``requeue``         ``true``: the job may be requeued when it is preempted (``--requeue``): SLURM
                    sends SIGTERM, the training saves within the partition's GraceTime, and the
                    job comes back with the same id and resumes. Default ``false``
                    (``--no-requeue``): a job the cluster ends (preempted, its node lost) goes to
                    the chain's retries instead of a silent requeue. Needs the training in a job
                    step (``distributed``, or a container): SLURM warns a preempted job's steps at
                    once but its batch shell only when the grace time is over.
``launcher``        ``distributed`` only: ``torchrun`` (default; one task per node running
                    torchrun with a c10d rendezvous on the first node) or ``srun`` (one task per
                    rank, RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT exported from SLURM's
                    variables).
``container``       optional ``{image: ..., mounts: [src:dst, ...]}``, rendered as pyxis's
                    ``srun --container-image`` / ``--container-mounts``.
``env``             optional mapping NAME -> value exported before the training starts. Names
                    must be shell identifiers; names that look like secrets (``*_API_KEY``,
                    ``*_TOKEN``, ``*PASSWORD*``, ``*_ACCESS_KEY``: contract/credentials.py) are
                    refused, since secrets come from
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

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from contract import job_env
from contract.credentials import looks_secret
from contract.gpus import GPU_KEYS
from contract.spelling import closest
from orchestrator.errors import UsageError
from orchestrator.slurm.time_limit import parse_time_minutes

CONTRACT_VARIABLES = (
    "SEED",
    job_env.CHAIN_ID,
    job_env.JOB_INDEX,
    job_env.NUM_JOBS,
    job_env.SEED,
    job_env.RUN_DIR,
    job_env.CODE_DIR,
    "SLURM_JOB_ID",
    "SLURM_NODEID",
)
MAX_SIGNAL_GRACE = 65535  # sbatch's limit for the @time of --signal

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED_NAME = re.compile(
    r"^(SEED|ORCH_\w+|SLURM_\w+|MASTER_ADDR|MASTER_PORT|RANK|WORLD_SIZE|LOCAL_RANK"
    r"|LOCAL_WORLD_SIZE)$"
)
_VARIABLE_REFERENCE = re.compile(r"\$\{([^}]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
# partition/account/qos land in #SBATCH comment lines, where quoting cannot contain a newline.
_SLURM_NAME = r"^[A-Za-z0-9_.,+@-]+$"


class FieldProblem(ValueError):
    """A project rule broken by one field, possibly below the one being validated (``env.X``)."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key = key


def _number_as_text(value: Any) -> Any:
    """YAML numbers become text (``time: 30``, ``--steps, 20``); booleans stay refused."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _check_word(word: str) -> str:
    """Refuse variable references other than ``${CONTRACT_VARIABLE}`` (see the module docstring)."""
    if "\0" in word:
        raise ValueError("holds a NUL byte, which no shell can pass")
    for match in _VARIABLE_REFERENCE.finditer(word):
        braced, bare = match.groups()
        if braced in CONTRACT_VARIABLES:
            continue
        if bare in CONTRACT_VARIABLES:
            raise ValueError(f"{word!r}: write ${{{bare}}} (with braces) to expand {bare}")
        allowed = ", ".join(f"${{{name}}}" for name in CONTRACT_VARIABLES)
        raise ValueError(
            f"{word!r} refers to {match.group(0)}, which a recipe does not expand; only {allowed}"
            " do. Write the value itself"
        )
    return word


def _time_limit(text: str) -> str:
    try:
        minutes = parse_time_minutes(text)
    except UsageError as error:
        raise ValueError(str(error)) from error
    if minutes is None or minutes <= 0:
        raise ValueError(f"{text!r}: a chain's jobs need a time limit above zero")
    return text.strip()


Word = Annotated[StrictStr, BeforeValidator(_number_as_text), AfterValidator(_check_word)]
TimeLimit = Annotated[StrictStr, BeforeValidator(_number_as_text), AfterValidator(_time_limit)]
SlurmName = Annotated[StrictStr, Field(pattern=_SLURM_NAME)]
Mount = Annotated[StrictStr, Field(min_length=1, pattern=r"^[^,]+$")]

# pydantic error types meaning "not the right shape": the field's description says what is.
_SHAPE_ERRORS = ("too_short", "list_type", "dict_type", "model_type", "model_attributes_type")
_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class Container(BaseModel):
    model_config = _STRICT

    image: StrictStr = Field(
        min_length=1, description="the image, e.g. nvcr.io#nvidia/pytorch:24.09-py3"
    )
    mounts: list[Mount] = Field(
        default_factory=list, description="a list of SRC:DST[:FLAGS] strings"
    )


class RecipeSettings(BaseModel):
    """Every field of a recipe but ``command``: what the chained launcher sets as well."""

    model_config = _STRICT

    template: Literal["single", "distributed"] = "single"
    nodes: int = Field(1, ge=1)
    spare_nodes: int = Field(0, ge=0)
    tasks_per_node: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    gpu: Literal[GPU_KEYS] | None = Field(None, description="a GPU model the planner knows")
    cpus_per_task: int = Field(1, ge=1)
    time: TimeLimit = Field("00:30:00", description="a SLURM time limit such as 30 or 02:00:00")
    partition: SlurmName | None = Field(None, description="letters, digits and _ . , + @ - only")
    account: SlurmName | None = Field(None, description="letters, digits and _ . , + @ - only")
    qos: SlurmName | None = Field(None, description="letters, digits and _ . , + @ - only")
    signal_grace: int = Field(120, ge=1, le=MAX_SIGNAL_GRACE)
    requeue: bool = False
    launcher: Literal["torchrun", "srun"] = "torchrun"
    container: Container | None = Field(None, description="a mapping {image: ..., mounts: [...]}")
    env: dict[StrictStr, Word] = Field(default_factory=dict, description="a mapping NAME: value")

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            key = f"env.{name}"
            if not _IDENTIFIER.match(name):
                raise FieldProblem(
                    key, "not a shell variable name (letters, digits and _, not first a digit)"
                )
            if looks_secret(name):
                raise FieldProblem(
                    key,
                    "looks like a secret; secrets come from the environment at run time "
                    "(export it before auto_launch), never from a recipe file",
                )
            if _RESERVED_NAME.match(name):
                raise FieldProblem(
                    key, "is set by the orchestrator, SLURM or the launcher; pick another name"
                )
            if "${SLURM_NODEID}" in value:
                raise FieldProblem(
                    key,
                    "env values expand in the batch shell, on the first node, so "
                    "${SLURM_NODEID} would be 0 for every node; use it in the command or read "
                    "it in the program",
                )
        return env

    @model_validator(mode="after")
    def _project_rules(self) -> RecipeSettings:
        if self.template == "single":
            if self.nodes != 1 or self.tasks_per_node != 1:
                key = "nodes" if self.nodes != 1 else "tasks_per_node"
                raise FieldProblem(
                    key, "template single runs one process on one node; use distributed"
                )
            if self.spare_nodes:
                raise FieldProblem(
                    "spare_nodes", "only template distributed runs its step on part of the nodes"
                )
            if "launcher" in self.model_fields_set:
                raise FieldProblem("launcher", "only template distributed has a launcher")
            if self.requeue and self.container is None:
                raise FieldProblem(
                    "requeue",
                    "needs the training in a job step (template distributed, or a container): "
                    "SLURM warns a preempted job's steps at once, but a training the batch "
                    "shell starts only when the grace time is over, too late to save",
                )
        limit_seconds = parse_time_minutes(self.time) * 60  # _time_limit refused UNLIMITED
        if self.signal_grace >= limit_seconds:
            raise FieldProblem(
                "signal_grace",
                f"{self.signal_grace} s must be less than the time limit ({self.time}) and at "
                f"most {MAX_SIGNAL_GRACE} s",
            )
        return self

    def container_flags(self) -> list[str]:
        """pyxis's srun options for the container; none without one."""
        if self.container is None:
            return []
        flags = [f"--container-image={self.container.image}"]
        if self.container.mounts:
            flags.append(f"--container-mounts={','.join(self.container.mounts)}")
        return flags


class Recipe(RecipeSettings):
    """A whole recipe: the settings and the one training process to start."""

    command: list[Word] = Field(
        min_length=1, description="the training's argv as a non-empty list of words"
    )

    def programs(self) -> tuple[str, ...]:
        """The programs its jobs start by name, from the PATH they inherit from auto_launch's
        shell: torchrun (the distributed template's default launcher) and the command's first
        word. None in a container, whose image has its own, or where ``env`` sets PATH."""
        if self.container is not None or "PATH" in self.env:
            return ()
        names = (
            ["torchrun"] if self.template == "distributed" and self.launcher == "torchrun" else []
        )
        first = self.command[0]
        if "/" not in first and "$" not in first:
            names.append(first)
        return tuple(names)


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's base-60 numbers: ``1:30:00`` stays a string, not 5400."""

    def resolve(self, kind: type, value: str, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and implicit[0] and ":" in value:
            return "tag:yaml.org,2002:str"
        return super().resolve(kind, value, implicit)


def load_recipe(path: Path | str) -> Recipe:
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


def parse_recipe(raw: Any, source: Path) -> Recipe:
    """Validate an already-parsed recipe mapping (``source`` only names it in messages)."""
    if not isinstance(raw, dict):
        raise UsageError(
            f"recipe {source}: the file must hold a mapping of fields "
            f"({', '.join(Recipe.model_fields)}), not {type(raw).__name__}"
        )
    return validated(Recipe, raw, f"recipe {source}")


def parse_settings(raw: dict[str, Any], source: str) -> RecipeSettings:
    """Validate recipe settings without a command (the chained launcher's)."""
    return validated(RecipeSettings, raw, source)


ModelT = TypeVar("ModelT", bound=BaseModel)


def validated(model: type[ModelT], raw: dict[str, Any], source: str) -> ModelT:
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        # An unknown field first: a misspelt name also makes the right one look missing.
        first = sorted(error.errors(), key=lambda item: item["type"] != "extra_forbidden")[0]
        key, problem = describe(first, model)
        raise UsageError(f"{source}: {key}: {problem}") from None


def explicit_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings whose values differ from the schema's defaults (what a user really set)."""
    return {
        name: value
        for name, value in settings.items()
        if value != RecipeSettings.model_fields[name].get_default(call_default_factory=True)
    }


def describe(error: dict[str, Any], model: type[BaseModel]) -> tuple[str, str]:
    """A pydantic error as (field, one-line problem): ``env.NAME``, ``command[1]``..."""
    kind, value, context = error["type"], error.get("input"), error.get("ctx") or {}
    cause = context.get("error")
    if isinstance(cause, FieldProblem):
        return cause.key, str(cause)
    location = [str(part) for part in error["loc"]]
    key = location[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in location[1:])
    hint = _description(model, location)
    if kind == "extra_forbidden":
        fields = list(_model_at(model, location[:-1]).model_fields)
        match = closest(location[-1], fields)
        meant = f" (did you mean {match}?)" if match else ""
        return key, f"unknown field{meant}; the fields are {', '.join(fields)}"
    if kind == "missing":
        return key, f"missing; give {hint}" if hint else "missing"
    if kind in _SHAPE_ERRORS and hint:
        return key, f"give {hint}"
    if kind == "value_error":
        return key, str(cause)
    if kind == "literal_error":
        return key, f"{value!r} is not one of {context['expected']}"
    if kind == "greater_than_equal":
        return key, f"{value} is less than {context['ge']}"
    if kind == "less_than_equal":
        return key, f"{value} is more than {context['le']}"
    if kind.startswith("int_"):
        return key, f"{value!r} is not a whole number"
    if kind == "string_type":
        return key, f"{value!r} is not a string or number; quote it in the YAML"
    problem = f"{value!r}: {error['msg'][:1].lower()}{error['msg'][1:]}"
    return key, f"{problem}; give {hint}" if hint else problem


def _model_at(model: type[BaseModel], location: list[str]) -> type[BaseModel]:
    """The model that holds the field at ``location`` (the container's, for container.X)."""
    for part in location:
        info = model.model_fields.get(part)
        nested = [
            arg
            for arg in typing.get_args(info.annotation if info else None)
            if isinstance(arg, type) and issubclass(arg, BaseModel)
        ]
        if not nested:
            break
        model = nested[0]
    return model


def _description(model: type[BaseModel], location: list[str]) -> str | None:
    """The description of the field at ``location``; None for list items and env entries."""
    info = _model_at(model, location[:-1]).model_fields.get(location[-1])
    return info.description if info is not None else None


def plain_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """The settings as dataclass fields of plain types, for a structured config (Hydra's).

    Values pass through unchecked there and are validated here when a recipe is built.
    """
    fields = []
    for name, info in RecipeSettings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        if isinstance(default, dict | list):
            spec = dataclasses.field(default_factory=type(default))
        else:
            spec = dataclasses.field(default=default)
        fields.append((name, _plain(info.annotation), spec))
    return fields


def _plain(annotation: Any) -> Any:
    """The type OmegaConf understands for a pydantic annotation."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return str
    if origin is Annotated:
        return _plain(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        others = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return typing.Optional[_plain(others[0])]  # noqa: UP045
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return dict[str, Any]
    if origin in (tuple, list):
        return list[Any]
    return annotation
