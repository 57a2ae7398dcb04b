"""The launchers' structured configs, registered in Hydra's ``hydra/launcher`` group by name.

No ``from __future__ import annotations``: Hydra's plugin scan runs this module outside
sys.modules, where dataclasses cannot resolve string annotations.
"""

from dataclasses import dataclass, make_dataclass

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf

from orchestrator.recipe import plain_fields

PACKAGE = "hydra_plugins.orch_chain_launcher"


@dataclass
class ChainSettings:
    """The chained launcher's own settings: each sweep member becomes a chain of ``n`` jobs, as
    ``auto_launch -n N`` makes. ``recipe``: a YAML recipe whose settings are used as they are and
    whose ``command`` is replaced by the member's. ``then``: a recipe each member's chain ends
    with, as ``auto_launch --then`` (e.g. an evaluation of the member's run). ``retries``: as
    ``auto_launch --retries``, replacement jobs each member's chain may queue.
    ``plan_check``: price each member's layout with the planner and refuse, before anything is
    queued, one that cannot fit the memory its ranks get. ``code``: as ``auto_launch --code``,
    what each member's jobs run (``snapshot``: the git work tree frozen into the member's run
    dir; ``live``; or a directory). ``arrays``: on SLURM, queue each link of every member as
    one job array (orchestrator/arrays.py), ``array_parallelism`` of its tasks at once."""

    _target_: str = f"{PACKAGE}.chain_launcher.ChainLauncher"
    backend: str = "slurm"  # slurm | local
    n: int = 1
    dependency: str = "afterany"
    # Reproducible seeds for every job of every member; None: fresh random seeds.
    base_seed: int | None = None
    recipe: str | None = None
    then: str | None = None
    retries: int = 0
    # Refuse members whose layout the planner says cannot fit (auto_launch --no-plan-check).
    plan_check: bool = True
    code: str = "snapshot"
    # On SLURM, each link of all members as one job array (false: a chain of jobs per member),
    # at most ``array_parallelism`` of its tasks running at once (submitit's name for it).
    arrays: bool = True
    array_parallelism: int | None = None


# The chain settings plus every recipe setting, with its default, from the one recipe schema
# (orchestrator.recipe.RecipeSettings); values are validated there when the sweep is planned.
ChainLauncherConf = make_dataclass("ChainLauncherConf", plain_fields(), bases=(ChainSettings,))


@dataclass
class MemberSlurmConf(SlurmQueueConf):
    """hydra-submitit-launcher's submitit_slurm, with a run dir and a seed for each member."""

    _target_: str = f"{PACKAGE}.submitit_members.SlurmMembersLauncher"
    base_seed: int | None = None


@dataclass
class MemberLocalConf(LocalQueueConf):
    """hydra-submitit-launcher's submitit_local, with a run dir and a seed for each member."""

    _target_: str = f"{PACKAGE}.submitit_members.LocalMembersLauncher"
    base_seed: int | None = None


_store = ConfigStore.instance()
_store.store(group="hydra/launcher", name="chain_slurm", node=ChainLauncherConf(backend="slurm"))
_store.store(group="hydra/launcher", name="chain_local", node=ChainLauncherConf(backend="local"))
_store.store(group="hydra/launcher", name="orch_submitit_slurm", node=MemberSlurmConf())
_store.store(group="hydra/launcher", name="orch_submitit_local", node=MemberLocalConf())
