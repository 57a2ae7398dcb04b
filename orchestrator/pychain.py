"""Chains of Python callables: the auto_launch chain (seeds, manifest, rollback) through submitit.

    from orchestrator.pychain import launch_callable_chain

    def train(seed: int, config: str) -> float: ...

    manifest = launch_callable_chain(train, 8, args=("tiny",), run_dir="runs/exp1")

Job k runs ``train(seed_k, *args)`` after job k-1 (SLURM dependency through submitit's
SlurmExecutor, or in order on this machine through its LocalExecutor), with the ORCH_* variables
of the .sub contract in its environment. The callable is pickled: define it in an importable
module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orchestrator.backends.submitit_common import FOLDER
from orchestrator.chain import ChainPlan, submit_chain
from orchestrator.errors import UsageError
from orchestrator.launch import LaunchJob, check_jobs, find_site, site_for
from orchestrator.manifest import Manifest
from orchestrator.slurm.resources import JobResources
from orchestrator.snapshot import SNAPSHOT


def launch_callable_chain(
    function: Callable[..., Any],
    num_jobs: int,
    *,
    args: Sequence[Any] = (),
    run_dir: str | Path | None = None,
    dependency: str = "afterany",
    seed: int | None = None,
    cluster: str | None = None,
    executor_params: dict[str, Any] | None = None,
    name: str | None = None,
    code: str = SNAPSHOT,
) -> Manifest:
    """Submit ``num_jobs`` chained jobs of ``function``; return the chain's manifest.

    ``cluster`` is ``slurm`` or ``local`` (default: slurm when a controller answers).
    ``executor_params`` go to the submitit executor (e.g. ``{"time": 240, "partition": "batch"}``);
    the resources they ask for are checked against the cluster's partitions (or this machine) as
    auto_launch checks a recipe's, before anything is queued. ``code``: what the jobs run, as
    ``auto_launch --code`` (``snapshot``, the default, ``live`` or a directory).
    """
    from orchestrator.backends.submitit_local import SubmititLocalBackend
    from orchestrator.backends.submitit_slurm import SubmititSlurmBackend

    executors = {kind.executor: kind for kind in (SubmititSlurmBackend, SubmititLocalBackend)}
    if cluster is not None and cluster not in executors:
        raise UsageError(f"cluster {cluster!r} is unknown: use one of {', '.join(executors)}")
    if not callable(function):
        raise UsageError(f"{function!r} is not callable")
    source = inspect.getsourcefile(function)
    if source is None:
        raise UsageError(f"{function!r} has no source file: define it in an importable module")
    plan = ChainPlan.create(
        job_name=name or function.__name__,
        recipe=Path(source),
        run_dir=Path(run_dir) if run_dir is not None else None,
        num_jobs=num_jobs,
        dependency_kind=dependency,
        base_seed=seed,
        function=function,
        function_args=tuple(args),
        code=code,
    )
    site = site_for(executors[cluster]) if cluster else find_site(SubmititSlurmBackend.option)
    resources = JobResources.from_executor_params(executor_params or {})
    check_jobs(site, [LaunchJob(resources, plan.job_name)])
    backend = site.backend(plan.run_dir / FOLDER, executor_params=executor_params)
    return submit_chain(plan, backend)
