"""``hydra/launcher=chain_slurm`` (or ``chain_local``): each sweep member becomes a chain of jobs.

The launcher only turns Hydra's members into orchestrator.sweep's request: the trainer's argv,
each member's overrides, run dir (``<sweep dir>/<job num>`` unless the member sets ``run_dir``)
and base seed (the member's ``seed=S`` if it sets one, else one derived from the launcher's
``base_seed``, else fresh seeds), and the ``then`` recipe every member's chain ends with. The
members are checked with the trainer's own validation for the recipe's rank count, then
orchestrator.sweep preflights, submits and registers the sweep.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from contract.configs import TRAIN_MODULE
from contract.job_env import CODE_DIR
from hydra_plugins.orch_chain_launcher.config import ChainSettings
from hydra_plugins.orch_chain_launcher.members import (
    fail,
    member_seeds,
    override_value,
    validate_members,
)
from orchestrator.errors import UsageError
from orchestrator.snapshot import SNAPSHOT, work_tree

# The chain sets these for every job: seed=${SEED}, run_dir=${ORCH_RUN_DIR}.
CHAIN_KEYS = ("seed", "run_dir")
# The launcher's own settings; every other one is a recipe setting.
CHAIN_SETTINGS = tuple(item.name for item in dataclasses.fields(ChainSettings))


class ChainLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        self.params = {
            key: OmegaConf.to_container(value, resolve=True)
            if OmegaConf.is_config(value)
            else value
            for key, value in params.items()
        }
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        try:
            return self._launch(job_overrides, initial_job_idx)
        except UsageError as error:
            fail(error)

    def _launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> list[JobReturn]:
        from orchestrator.arrays import check_parallelism
        from orchestrator.chain import ThenJob
        from orchestrator.recipe import explicit_settings, parse_settings
        from orchestrator.sweep import (
            SweepMember,
            SweepRequest,
            new_sweep_id,
            print_sweep,
            recipe_resources,
            submit_sweep,
        )

        assert self.config is not None and self.hydra_context is not None
        params = self.params
        if params["recipe"]:
            resources = recipe_resources(Path(str(params["recipe"])))
        else:
            settings = {k: v for k, v in params.items() if k not in CHAIN_SETTINGS}
            resources = explicit_settings(settings)
        then = ThenJob.load(str(params["then"]), "hydra.launcher.then") if params["then"] else None
        given = params["array_parallelism"]
        parallelism = None if given is None else int(given)
        check_parallelism(parallelism, "hydra.launcher.array_parallelism")
        shape = parse_settings(resources, "hydra.launcher")
        world_size = shape.nodes * shape.tasks_per_node
        configs = validate_members(
            self.hydra_context, self.config, job_overrides, initial_job_idx, world_size
        )
        config_name = str(self.config.hydra.job.config_name)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        seeds = member_seeds(initial_job_idx + len(job_overrides), params["base_seed"])
        members = []
        for offset, (overrides, cfg) in enumerate(zip(job_overrides, configs, strict=True)):
            index = initial_job_idx + offset
            own_seed = override_value(overrides, "seed")
            own_run_dir = override_value(overrides, "run_dir")
            members.append(
                SweepMember(
                    index=index,
                    overrides=tuple(
                        item
                        for item in overrides
                        if item.partition("=")[0].lstrip("+") not in CHAIN_KEYS
                    ),
                    run_dir=Path(own_run_dir) if own_run_dir else sweep_dir / str(index),
                    base_seed=int(own_seed) if own_seed is not None else seeds[index],
                    config=cfg if params["plan_check"] else None,
                )
            )
        request = SweepRequest(
            sweep_id=new_sweep_id(config_name),
            job_name=config_name,
            train_argv=(
                sys.executable,
                "-m",
                TRAIN_MODULE,
                *config_path_args(self.config, str(params["code"])),
                "--config-name",
                config_name,
            ),
            resources=resources,
            num_jobs=int(params["n"]),
            dependency=str(params["dependency"]),
            backend=str(params["backend"]),
            workdir=Path.cwd(),
            then=then,
            retries=int(params["retries"]),
            code=str(params["code"]),
            arrays=bool(params["arrays"]),
            array_parallelism=parallelism,
        )
        manifests = submit_sweep(request, members)
        print_sweep(request.sweep_id, request.num_jobs, manifests)
        return [
            JobReturn(
                overrides=list(member.overrides),
                working_dir=manifest.run_dir,
                task_name=config_name,
                status=JobStatus.COMPLETED,
                _return_value=manifest.chain_id,
            )
            for member, manifest in zip(members, manifests, strict=True)
        ]


def config_path_args(config: DictConfig, code: str) -> list[str]:
    """The config folders a user gave (``--config-path``, ``--config-dir``), so that every job
    reads the same configs; the packaged ones need no argument. Under a code snapshot, a folder
    of the work tree is read from the member's snapshot (``${ORCH_CODE_DIR}/...``): the configs
    as they were at submission."""
    tree = work_tree(Path.cwd()) if code == SNAPSHOT else None
    args: list[str] = []
    for source in config.hydra.runtime.config_sources:
        if source.schema != "file":
            continue
        path = Path(source.path).resolve()
        where = str(path)
        if tree is not None and path.is_relative_to(tree):
            where = "${" + CODE_DIR + "}/" + path.relative_to(tree).as_posix()
        if source.provider == "main":
            args += ["--config-path", where]
        elif source.provider == "command-line":
            args += ["--config-dir", where]
    return args
