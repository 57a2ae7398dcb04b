"""Many members' chains as SLURM job arrays: each link of every member in one submission.

A chained sweep (``hydra/launcher=chain_slurm``, ``auto_launch --members``) of M members of N
jobs each queues N arrays (and one more for a --then job), not M x N jobs. Link k is one
``sbatch --array=<member indexes>%P``, task i running member i's job k. Each member keeps its
own chain: manifest, run dir, seeds exactly as a chain of its own, judgement by the chain hook;
only the queueing changes. The array's script is a dispatcher written at launch: a table from
task id to the member's job (its script copy, seed, ORCH_* variables, code and work dir), then
``exec`` of the member's own script, which so runs exactly as in a chain of its own, in the
process SLURM signals. Its log goes where the member's would: SLURM writes it through the
sweep's task directory, whose ``<task id>`` links lead to the members' run dirs.

Link k+1 waits on link k task by task (``aftercorr``): a member's task starts once its own
previous task has ended, whatever the other members do. SLURM satisfies aftercorr only by a
clean end (COMPLETED, exit 0), while a chain of its own waits with afterany, so that the job
after a failure still starts (and judges it). To keep that rule exactly, whoever judges an
unclean end points the member's next task at it with afterany (one ``scontrol update`` per
unclean end, ``ChainKeeper.release_successors``): the end hook for its own task, the start
hook for a task that died without running its own, ``end_chain`` for the tasks it cancels
(the --then task still runs). A task whose predecessor died with its batch shell (its node
lost, SIGKILL) waits as DependencyNeverSatisfied until the next start of any task of the
sweep frees it (``stuck_run_dirs``), or ``python -m orchestrator.chain_hooks check RUN_DIR``.

The first link is queued held and released once every member's manifest holds every task
(each written once, whole), so that no task starts (and runs its hook) before its record
exists; a failed submission cancels the arrays already queued before any task ran, and marks
every member's chain rolled back. Each array is on record in the task directory's
``arrays.json`` as soon as SLURM accepts it: a launch killed before the manifests are written
leaves held arrays that never run, named there for ``scancel``.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from contract import job_env
from contract.run_dir import LOGS_DIR
from orchestrator.backends.slurm import ArraySubmission, SlurmBackend
from orchestrator.chain import ChainPlan, contract_env, last_first, new_manifest, write_scripts
from orchestrator.errors import SchedulerError, UsageError
from orchestrator.manifest import (
    ROLLED_BACK,
    SUBMITTED,
    JobRecord,
    Manifest,
    register_chain,
)
from orchestrator.slurm.directives import directive_lines
from orchestrator.snapshot import freeze

# How a link waits on the link before it, task by task; how a freed task waits instead.
CORRESPONDING = "aftercorr"
FREED = "afterany"
ARRAYS_FILE = "arrays.json"  # in the task directory: the sweep's arrays, link by link
# squeue's reason for a task whose aftercorr predecessor ended unclean.
NEVER_SATISFIED = "DependencyNeverSatisfied"


@dataclass(frozen=True)
class Task:
    """One member's job of one link: what its line of the dispatcher's table sets."""

    member: int  # the task id
    workdir: Path
    script: Path
    seed: int
    args: tuple[str, ...]
    env: dict[str, str]


@dataclass(frozen=True)
class Link:
    """One array: a link of the chains, or their --then jobs."""

    number: int  # the job index of every task in it
    name: str
    header: list[str]  # the members' #SBATCH lines
    tasks: tuple[Task, ...]
    then: bool = False


def task_ranges(indexes: Sequence[int]) -> str:
    """sbatch's --array list of ``indexes``: ``0-3,5,7-9``."""
    ordered = sorted(set(indexes))
    parts: list[str] = []
    start = previous = ordered[0]
    for index in [*ordered[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if index is not None:
            start = previous = index
    return ",".join(parts)


def array_spec(indexes: Sequence[int], parallelism: int | None) -> str:
    """``--array``'s value: the task ids, and ``%P`` where at most P may run at once."""
    return task_ranges(indexes) + (f"%{parallelism}" if parallelism else "")


def check_parallelism(parallelism: int | None, option: str) -> None:
    if parallelism is not None and parallelism < 1:
        raise UsageError(f"{option} {parallelism}: give at least 1 (or none: no throttle)")


def check_limits(tasks_per_array: int, largest_index: int, tasks: int, limits: dict) -> None:
    """Refuse, before anything is queued, arrays the cluster would refuse or could not hold:
    a task id at or above MaxArraySize, or more tasks than MaxJobCount leaves room for."""
    max_array = limits.get("MaxArraySize")
    if max_array is not None and largest_index >= max_array:
        raise UsageError(
            f"the sweep's arrays need task ids up to {largest_index}, and this cluster's "
            f"MaxArraySize is {max_array} (ids 0..{max_array - 1}): split the sweep into parts "
            f"of at most {max_array} members, or ask the admins to raise MaxArraySize"
        )
    max_jobs, queued = limits.get("MaxJobCount"), limits.get("queued", 0)
    if max_jobs is not None and queued + tasks > max_jobs:
        raise UsageError(
            f"the sweep queues {tasks} tasks ({tasks_per_array} members x "
            f"{tasks // max(tasks_per_array, 1)} arrays) and the queue holds {queued} jobs: "
            f"more than this cluster's MaxJobCount of {max_jobs}; queue fewer members or links "
            "at once"
        )


def tasks_dir(plans: Sequence[tuple[int, ChainPlan]], sweep_id: str) -> Path:
    """The sweep's task directory, beside the first member's run dir (on the shared
    filesystem the run dirs are on): SLURM opens each task's log through it."""
    return plans[0][1].run_dir.parent / f".tasks-{sweep_id}"


def member_task(member: int, plan: ChainPlan, number: int, directory: Path) -> Task:
    """Member ``member``'s job ``number`` (the --then job where the plan says so)."""
    request = plan.request(number, None)
    assert request.script is not None
    env = {**contract_env(plan, number), job_env.SWEEP_TASKS: str(directory)}
    return Task(member, request.workdir, request.script, request.seed, request.script_args, env)


def links_of(plans: Sequence[tuple[int, ChainPlan]], directory: Path) -> list[Link]:
    """The arrays that queue every member's jobs: one per link, one for the --then jobs."""
    first = plans[0][1]
    links = []
    for number in range(first.total_jobs):
        then = first.is_then(number)
        text = first.then.script_text if then and first.then else first.script_text
        assert text is not None
        header = directive_lines(text)
        tasks = tuple(member_task(index, plan, number, directory) for index, plan in plans)
        name = first.then.job_name if then and first.then else first.job_name
        links.append(Link(number, name, header, tasks, then))
    return links


def check_alike(plans: Sequence[tuple[int, ChainPlan]]) -> None:
    """One array carries one set of resources: every member's scripts ask for the same ones."""
    first_index, first = plans[0]
    headers = [directive_lines(text) for _, _, text in first.script_copies()]
    for index, plan in plans:
        if plan.function is not None or plan.script_text is None:
            raise UsageError("job arrays run batch scripts, not Python callables")
        theirs = [directive_lines(text) for _, _, text in plan.script_copies()]
        if plan.total_jobs != first.total_jobs or theirs != headers:
            raise UsageError(
                f"member {index}'s jobs differ from member {first_index}'s in number or "
                "#SBATCH lines: one array asks for one set of resources"
            )


def dispatcher_text(link: Link) -> str:
    """The array's batch script: the members' #SBATCH lines, then task ``i`` sets member i's
    variables, enters its work dir and ``exec``s its script with its seed (every value
    quoted)."""
    kind = "--then job" if link.then else f"job {link.number}"
    lines = [
        "#!/bin/bash",
        f"# Each task runs one sweep member's {kind}: the task id is the member's index",
        "# (orchestrator/arrays.py; written at submission, immune to later edits).",
        *link.header,
        "set -euo pipefail",
        'case "${SLURM_ARRAY_TASK_ID:-}" in',
    ]
    for task in link.tasks:
        env = sorted(task.env.items())
        exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in env)
        command = shlex.join([str(task.script), str(task.seed), *task.args])
        lines.append(
            f"  {task.member}) export {exports}\n"
            f"    cd {shlex.quote(str(task.workdir))}\n"
            f"    exec {command} ;;"
        )
    lines += [
        '  *) echo "error: task ${SLURM_ARRAY_TASK_ID:-none} is no member of this sweep" >&2',
        "    exit 2 ;;",
        "esac",
    ]
    return "\n".join(lines) + "\n"


def log_path(directory: Path, name: str) -> Path:
    """sbatch's --output for an array: each task's log in its member's ``logs``, named as a
    job's log is (``<name>-<job id>.out``, the job id being ``<array id>_<task id>``)."""
    return directory / "%a" / LOGS_DIR / f"{name}-%A_%a.out"


def link_members(plans: Sequence[tuple[int, ChainPlan]], directory: Path) -> None:
    """The task directory: ``<task id>`` -> the member's run dir."""
    directory.mkdir(parents=True, exist_ok=True)
    for index, plan in plans:
        link = directory / str(index)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(plan.run_dir, target_is_directory=True)


def submit_arrays(
    plans: Sequence[tuple[int, ChainPlan]],
    backend: SlurmBackend,
    sweep_id: str,
    parallelism: int | None,
) -> list[Manifest]:
    """Queue every member's chain as arrays (see the module); the members' manifests, saved
    and registered. A submission that fails cancels what was queued and rolls every member
    back."""
    check_alike(plans)
    directory = tasks_dir(plans, sweep_id)
    link_members(plans, directory)
    for code in {plan.code for _, plan in plans if plan.code is not None}:
        freeze(code)
    manifests = [prepared(plan, backend.label) for _, plan in plans]
    indexes = [index for index, _ in plans]
    queued: list[str] = []
    try:
        for link in links_of(plans, directory):
            after = queued[-1] if queued else None
            submission = array_submission(link, directory, indexes, parallelism, after)
            submission.script.write_text(dispatcher_text(link))
            array_id = backend.submit_array(submission)
            queued.append(array_id)
            write_arrays(directory, sweep_id, queued)  # on record at once
            now = time.time()
            for (index, plan), manifest in zip(plans, manifests, strict=True):
                manifest.jobs.append(
                    JobRecord(
                        index=link.number,
                        seed=plan.seeds[link.number],
                        job_id=f"{array_id}_{index}",
                        dependency=f"{CORRESPONDING}:{after}" if after else None,
                        submit_time=now,
                        then=link.then,
                    )
                )
        for manifest in manifests:
            saved(manifest)
        backend.release(queued[0])
    except (SchedulerError, KeyboardInterrupt, OSError) as error:
        roll_back(manifests, queued, backend, error)
        raise
    return manifests


def prepared(plan: ChainPlan, backend_label: str) -> Manifest:
    """A member's run dir made ready (its logs folder, its scripts) and its manifest, unsaved."""
    (plan.run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    write_scripts(plan)
    return new_manifest(plan, backend_label)


def saved(manifest: Manifest) -> None:
    """A member's manifest on record, every task in it, and in the index of chains."""
    manifest.status = SUBMITTED
    manifest.save()
    register_chain(manifest)


def array_submission(
    link: Link, directory: Path, indexes: list[int], parallelism: int | None, after: str | None
) -> ArraySubmission:
    """How ``link`` is queued: its dispatcher in the task directory, every member's task,
    waiting task by task on the array ``after`` (None: the first link, queued held)."""
    name = f"then-{link.name}" if link.then else f"link-{link.number}"
    return ArraySubmission(
        script=directory / f"{name}.sub",
        job_name=link.name,
        output=log_path(directory, link.name),
        workdir=directory,
        tasks=array_spec(indexes, parallelism),
        dependency=f"{CORRESPONDING}:{after}" if after else None,
        hold=after is None,
    )


def array_submissions(
    plans: Sequence[tuple[int, ChainPlan]], sweep_id: str, parallelism: int | None
) -> list[ArraySubmission]:
    """What ``submit_arrays`` would queue, for a dry run (the ids it waits on are named)."""
    directory = tasks_dir(plans, sweep_id)
    indexes = [index for index, _ in plans]
    return [
        array_submission(
            link, directory, indexes, parallelism, f"<array {number - 1}>" if number else None
        )
        for number, link in enumerate(links_of(plans, directory))
    ]


def write_arrays(directory: Path, sweep_id: str, arrays: list[str]) -> None:
    payload = {"sweep_id": sweep_id, "arrays": arrays}
    tmp = directory / f".{ARRAYS_FILE}.tmp"
    tmp.write_text(json.dumps(payload) + "\n")
    os.replace(tmp, directory / ARRAYS_FILE)


def read_arrays(directory: Path) -> list[str]:
    try:
        return list(json.loads((directory / ARRAYS_FILE).read_text())["arrays"])
    except (OSError, ValueError, KeyError):
        return []


def roll_back(
    manifests: list[Manifest], queued: list[str], backend: SlurmBackend, error: BaseException
) -> None:
    """Cancel the arrays queued (last first: none was released) and mark every member."""
    said = f"its {len(queued)} queued array(s) are cancelled"
    try:
        backend.cancel(last_first(queued))
    except SchedulerError as failure:
        said = (
            f"cancelling its queued arrays ({' '.join(queued)}) failed too "
            f"({str(failure).splitlines()[0]}): `scancel` them once SLURM answers"
        )
    reason = str(error) or type(error).__name__
    for manifest in manifests:
        manifest.status = ROLLED_BACK
        manifest.error = f"{reason}. The sweep is rolled back: {said}."
        manifest.save()
        register_chain(manifest)


def successor_of(record: JobRecord, job_id: str) -> bool:
    """Whether ``record`` waits on ``job_id`` task by task (its array's aftercorr)."""
    mine, theirs = job_env.array_task(str(record.job_id)), job_env.array_task(job_id)
    if mine is None or theirs is None or mine[1] != theirs[1]:
        return False
    return record.dependency == f"{CORRESPONDING}:{theirs[0]}"


def stuck_tasks(directory: Path, query: Callable[[list[str]], str]) -> dict[Path, list[str]]:
    """The tasks that can never start (their predecessor ended unclean and nobody freed them),
    by their member's run dir: one squeue for the whole sweep, ``query(argv)``."""
    arrays = read_arrays(directory)
    if not arrays:
        return {}
    output = query(
        [
            "squeue",
            "--noheader",
            "--array",
            "--states=PENDING",
            "--jobs",
            ",".join(arrays),
            "--format=%i|%r",
        ]
    )
    found: dict[Path, list[str]] = {}
    for line in output.splitlines():
        job_id, _, reason = line.strip().partition("|")
        parts = job_env.array_task(job_id)
        if reason.strip() == NEVER_SATISFIED and parts is not None:
            found.setdefault((directory / parts[1]).resolve(), []).append(job_id)
    return found
