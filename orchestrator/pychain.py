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

from orchestrator.chain import ChainPlan, new_chain_id, submit_chain
from orchestrator.errors import UsageError
from orchestrator.manifest import Manifest, orch_home
from orchestrator.preflight import check_dependency, check_num_jobs, check_run_dir
from orchestrator.seeds import chain_seeds, validate_base_seed
from orchestrator.slurm_commands import slurm_available


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
) -> Manifest:
    """Submit ``num_jobs`` chained jobs of ``function``; return the chain's manifest.

    ``cluster`` is ``slurm`` or ``local`` (default: slurm when a controller answers).
    ``executor_params`` go to the submitit executor (e.g. ``{"time": 240, "partition": "batch"}``).
    """
    from orchestrator.backends.submitit_backend import SubmititBackend

    if not callable(function):
        raise UsageError(f"{function!r} is not callable")
    check_num_jobs(num_jobs)
    check_dependency(dependency)
    if seed is not None:
        validate_base_seed(seed)
    source = inspect.getsourcefile(function)
    if source is None:
        raise UsageError(f"{function!r} has no source file: define it in an importable module")
    job_name = name or function.__name__
    chain_id = new_chain_id(job_name)
    resolved_run_dir = Path(run_dir or orch_home() / "runs" / chain_id).expanduser().resolve()
    check_run_dir(resolved_run_dir)
    kind = cluster or ("slurm" if slurm_available() else "local")
    plan = ChainPlan(
        chain_id=chain_id,
        recipe=Path(source),
        script_text=None,
        run_dir=resolved_run_dir,
        workdir=Path.cwd(),
        num_jobs=num_jobs,
        seeds=tuple(chain_seeds(num_jobs, seed)),
        dependency_kind=dependency,
        script_args=(),
        base_seed=seed,
        job_name=job_name,
        function=function,
        function_args=tuple(args),
    )
    backend = SubmititBackend(
        resolved_run_dir / "submitit", cluster=kind, executor_params=executor_params
    )
    return submit_chain(plan, backend)
