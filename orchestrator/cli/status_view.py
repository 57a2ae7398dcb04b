"""``orchestrator status``: a chain's jobs as a table or ``--json``, and a sweep's members
ranked."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from contract.job_end import read_job_end
from orchestrator.backends.base import JobStatus
from orchestrator.chain_status import chain_status
from orchestrator.cli.chain_view import (
    code_line,
    format_loss,
    index_label,
    looked_at,
    print_table,
    summary,
)
from orchestrator.manifest import JobRecord, Manifest, find_manifests, sweep_labels
from orchestrator.results import (
    RunResults,
    as_json,
    disk_problem,
    format_wer,
    last_progress,
    slow_ranks,
)


def cmd_status(args: argparse.Namespace) -> int:
    manifests = find_manifests(args.chain)
    results = {manifest.chain_id: RunResults.of(manifest.run_dir) for manifest in manifests}
    labels = sweep_labels(args.chain)
    payloads = []
    for manifest, (backend, statuses) in zip(manifests, looked_at(manifests), strict=True):
        found = results[manifest.chain_id]
        unreachable = (backend.unreachable, backend.accounting_unreachable)
        if args.json:
            payloads.append(status_payload(manifest, statuses, found, *unreachable))
        else:
            print_status(status_payload(manifest, statuses, found, *unreachable), found)
    if labels is None:
        if args.json:
            print(json.dumps(payloads[0]))
        return 0
    ranked = sorted(manifests, key=lambda manifest: results[manifest.chain_id].rank_key())
    if args.json:
        best_first = [manifest.chain_id for manifest in ranked]
        print(json.dumps({"sweep_id": args.chain, "chains": payloads, "best_first": best_first}))
    else:
        print_ranking(args.chain, ranked, results, labels)
    return 0


def status_payload(
    manifest: Manifest,
    statuses: dict[str, JobStatus],
    results: RunResults,
    unreachable: str | None = None,
    accounting_unreachable: str | None = None,
) -> dict:
    """What ``status`` says about a chain: ``--json`` prints it, the table is drawn from it."""
    found = chain_status(manifest, statuses)
    payload = summary(manifest, statuses, found)
    payload["error"] = manifest.error
    payload["ended"] = found.why
    payload["controller_unreachable"] = unreachable
    payload["accounting_unreachable"] = accounting_unreachable
    progress = last_progress(manifest)
    for row, job in zip(payload["jobs"], manifest.jobs, strict=True):
        status = statuses.get(row["job_id"])
        record = read_job_end(manifest.run_dir, str(job.index), str(job.job_id))
        row["nodes"] = status.nodes if status else ""
        row["error"] = record.get("error") if record else None
        row["reason"] = job_reason(job, status, row["error"])
        # the training's own status: the batch shell's may be its end signal's (143)
        row["exit_code"] = record["exit_code"] if record else status.exit_code if status else None
        row["elapsed"] = status.elapsed if status else ""
        row["source"] = status.source if status else ""
        row["last_step"], row["last_loss"] = progress.get(job.index, (None, None))
    payload["disk_problem"] = disk_problem(Path(manifest.run_dir))
    payload["slow"] = slow_ranks(manifest)
    payload["slow_nodes"] = [decision.line() for decision in manifest.slow_nodes]
    payload["validation"] = as_json(results.validation)
    payload["evaluation"] = as_json(results.evaluation)
    return payload


def unreachable_notice(unreachable: str) -> str:
    return (
        f"SLURM controller unreachable ({unreachable}): states below come from accounting "
        "(sacct) where it answers, else from the manifest and the run dir (logs, metrics)"
    )


def accounting_notice(unreachable: str) -> str:
    return (
        f"accounting (slurmdbd) unreachable ({unreachable}): jobs that left the queue are read "
        "from scontrol while it remembers them, else from the manifest and the run dir"
    )


def job_reason(job: JobRecord, status: JobStatus | None, error: str | None = None) -> str:
    """The scheduler's reason, after what the chain's judgement made of the job (its outcome,
    the trainer's ``error:`` line, and for a replacement the job it replaces)."""
    parts = []
    if job.outcome:
        parts.append(job.outcome)
    if error:
        parts.append(f"error: {error}")
    if job.replaces is not None:
        parts.append(f"replaces job {job.replaces}" + (f" ({job.reason})" if job.reason else ""))
    if job.restarts:
        parts.append(f"preempted and requeued {job.restarts}x")
    if job.in_job_restarts:
        parts.append(f"restarted in place {job.in_job_restarts}x")
    for slow in job.slow:
        parts.append(f"slow: node {slow.get('node')}, rank {slow.get('rank')}")
    if job.avoids:
        parts.append(f"stays off slow {', '.join(job.avoids)}")
    if status and status.reason:
        parts.append(status.reason)
    return "; ".join(parts)


def print_status(payload: dict, results: RunResults) -> None:
    """The chain's status as a table: ``status_payload``'s, so the two never disagree."""
    chain, backend, run_dir = payload["chain_id"], payload["backend"], payload["run_dir"]
    print(
        f"chain {chain} ({backend}, {payload['status']})  {run_dir}  {code_line(payload['code'])}"
    )
    if payload["controller_unreachable"]:
        print(unreachable_notice(payload["controller_unreachable"]))
    if payload["accounting_unreachable"]:
        print(accounting_notice(payload["accounting_unreachable"]))
    if payload["disk_problem"]:
        print(f"warning: {payload['disk_problem']}")
    if payload["error"]:
        print(f"error: {payload['error']}")
    if payload["ended"] and payload["status"] != "complete":
        print(f"{payload['status']}: {payload['ended']}")
    print(f"latest: {results.describe()}")
    for line in payload["slow"] + payload["slow_nodes"]:
        print(line)
    per_set = results.per_set()
    if per_set:
        print_table(
            [
                [name, format_loss(val_loss), format_wer(wer) if wer is not None else "-"]
                for name, (val_loss, wer) in per_set.items()
            ],
            ["set", "val_loss", "wer"],
        )
    rows = [
        [
            index_label(job["index"], job["then"]),
            str(job["job_id"]),
            str(job["seed"]),
            job["state"] or "?",
            "-" if job["last_step"] is None else str(job["last_step"]),
            format_loss(job["last_loss"]),
            "-" if job["exit_code"] is None else str(job["exit_code"]),
            job["elapsed"] or "-",
            job["nodes"],
            job["reason"],
        ]
        for job in payload["jobs"]
    ]
    header = ["index", "job_id", "seed", "state", "step", "loss", "exit", "elapsed", "nodes"]
    print_table(rows, [*header, "reason"])


def print_ranking(
    sweep_id: str,
    ranked: list[Manifest],
    results: dict[str, RunResults],
    labels: dict[str, str],
) -> None:
    """The sweep's members best first (by WER, else val_loss), each with what set it apart."""
    print(f"sweep {sweep_id}: {len(ranked)} member(s), best first")
    rows = []
    for rank, manifest in enumerate(ranked, start=1):
        found = results[manifest.chain_id]
        evaluation, validation = found.evaluation, found.validation
        label = labels.get(manifest.chain_id, manifest.chain_id)
        rows.append(
            [
                str(rank),
                manifest.chain_id,
                format_wer(evaluation.wer) if evaluation else "-",
                str(evaluation.step) if evaluation else "-",
                format_loss(validation.val_loss if validation else None),
                str(validation.step) if validation else "-",
                "" if label == manifest.chain_id else label,
            ]
        )
    header = ["rank", "chain", "wer", "eval_step", "val_loss", "val_step", "overrides"]
    print_table(rows, header)
