"""Leaving a slow node out of a chain's next jobs: what the chain hook decides once a job's
trainer named a rank slow (train/loop/straggler.py, the end-of-job record's ``slow``).

Each node named is excluded from the chain's later jobs (their ``--exclude``: an ``scontrol
update`` of the queued ones, sbatch's option for a replacement) when the chain's cap
(``auto_launch --exclude-slow-nodes N``) leaves room and the job's partition keeps enough other
usable nodes for it; else it is left in, and the chain's record says why. With
``--readmit-slow-nodes K`` the node may run the chain's jobs again K jobs after the one that
named it (a fan replaced, a neighbour gone); by default never. A node never named is never
excluded. The decisions are pure functions here; orchestrator/chain_hooks.py applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Nodes a chain may leave out by default: one bad node is common on a large allocation, two
# still leaves almost all of a partition; more and the blame itself is the likelier fault.
DEFAULT_EXCLUDE_SLOW_NODES = 2
MAX_EXCLUDE_SLOW_NODES = 1000
# sinfo's node states (``%t``) in which a node can run a job. A state with a flag appended
# (``*`` not responding, ``~`` powered off, ``#`` powering up, ``%`` powering down, ``!``
# pending power down, ``$`` maintenance) is not one of them.
USABLE_STATES = frozenset(
    {"idle", "alloc", "allocated", "mix", "mixed", "comp", "completing", "resv", "reserved"}
)


@dataclass
class NodeDecision:
    """A node a job's trainer named slow, and what the chain made of it: left out of the jobs
    from ``job + 1`` until ``readmit_at`` (None: the chain's end), or ``kept`` in (and why)."""

    node: str
    why: str  # who named it: "rank 1, 1.84x the other ranks' median at step 40 of job 0 (id 7)"
    job: int  # the index of the job whose trainer named it
    readmit_at: int | None = None  # the first job index that may run on it again
    kept: str | None = None  # why it was not excluded (the cap, the partition's size)

    @property
    def excluded(self) -> bool:
        return self.kept is None

    def avoided_by(self, index: int) -> bool:
        """Whether job ``index`` of the chain stays off the node."""
        return (
            self.excluded
            and index > self.job
            and (self.readmit_at is None or index < self.readmit_at)
        )

    def line(self) -> str:
        """How ``orchestrator status`` lists it."""
        if not self.excluded:
            return (
                f"slow node {self.node} kept in the chain's later jobs: {self.kept} "
                f"(named by {self.why})"
            )
        until = "" if self.readmit_at is None else f" until job {self.readmit_at}"
        return f"slow node {self.node} excluded from job {self.job + 1} on{until} ({self.why})"


def named_by(entry: dict[str, Any], job_index: int, job_id: str) -> str:
    """The ``why`` of a decision, from one entry of an end-of-job record's ``slow``."""
    gpu = f" (GPU {entry['gpu']})" if entry.get("gpu") is not None else ""
    return (
        f"rank {entry.get('rank')}{gpu}, {entry.get('ratio')}x the other ranks' median at "
        f"step {entry.get('step')} of job {job_index} (id {job_id})"
    )


def usable_nodes(states: dict[str, str]) -> set[str]:
    """The nodes of ``states`` (node -> sinfo's ``%t``) that can run a job now."""
    return {node for node, state in states.items() if state in USABLE_STATES}


def decide(
    node: str,
    *,
    why: str,
    job: int,
    decided: list[NodeDecision],
    cap: int,
    readmit_after: int,
    usable: set[str],
    needed: int,
    partition: str,
) -> NodeDecision:
    """What to do with ``node``, named slow by job ``job``: exclude it while the chain has
    fewer than ``cap`` nodes out for its next job and the partition keeps ``needed`` usable
    nodes without it and the others out; else keep it, saying why."""
    readmit_at = job + 1 + readmit_after if readmit_after else None
    out = {d.node for d in decided if d.avoided_by(job + 1)}
    if not cap:
        kept = "the chain excludes no node (--exclude-slow-nodes 0)"
    elif len(out) >= cap:
        kept = f"{len(out)} node(s) already out, the chain's cap (--exclude-slow-nodes {cap})"
    elif len(usable - out - {node}) < needed:
        left = len(usable - out - {node})
        kept = (
            f"partition {partition} would keep {left} usable node(s) without it, and the "
            f"chain's jobs need {needed}"
        )
    else:
        kept = None
    return NodeDecision(node=node, why=why, job=job, readmit_at=readmit_at, kept=kept)


def exclusions_for(decided: list[NodeDecision], index: int) -> list[str]:
    """The nodes job ``index`` of the chain stays off, in the order they were named."""
    return [decision.node for decision in decided if decision.avoided_by(index)]


def exclude_option(user: str, nodes: list[str]) -> str:
    """The job's ``--exclude`` value: the recipe's own (a SLURM hostlist) and the chain's."""
    return ",".join(([user] if user else []) + nodes)
