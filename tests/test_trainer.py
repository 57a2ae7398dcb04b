"""The training entrypoint as jobs run it: real processes, real corpus, real checkpoints."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException

from contract.job_end import read_job_end
from orchestrator.planner.plan_check import compose_training_config
from tests.harness.chains import launch_training, wait_chain
from tests.harness.process import run_tool
from tests.harness.training import final_weights, metrics, train, train_together
from train.config import ConfigError
from train.trainer import preflight


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        (["parallel.dp_shard=2"], {}, "world has 1 ranks"),
        (["parallel.tp=3"], {"WORLD_SIZE": "3"}, "heads"),
        (
            ["model.preset=tiny_moe", "parallel.ep=3", "parallel.dp_shard=3"],
            {"WORLD_SIZE": "3"},
            "experts",
        ),
        (["parallel.cp=3"], {"WORLD_SIZE": "2"}, "dp_shard=-1 cannot fill a world of 2"),
        (
            ["parallel.cp=2", "strategy=ddp", "parallel.dp_replicate=1", "parallel.dp_shard=1"],
            {"WORLD_SIZE": "2"},
            "cp=1",
        ),
        (["parallel.pp=4"], {"WORLD_SIZE": "4"}, "more pipeline stages than the model's 2"),
        (["parallel.pp=2", "parallel.pp_microbatches=1"], {"WORLD_SIZE": "2"}, "fewer than pp"),
        (
            [
                "model.preset=tiny_deep",
                "parallel.pp=3",
                "parallel.pp_schedule=interleaved_1f1b",
                "parallel.pp_stages_per_rank=1",
            ],
            {"WORLD_SIZE": "3"},
            "divide evenly",
        ),
        (
            ["parallel.pp=2", "strategy=ddp", "parallel.dp_shard=1"],
            {"WORLD_SIZE": "2"},
            "pp=1",
        ),
        (["parallel.pp=2", "parallel.pp_schedule=pipedream"], {"WORLD_SIZE": "2"}, "unknown"),
        (["parallel.pp=2", "parallel.pp_schedule=zero_bubble"], {"WORLD_SIZE": "2"}, "zero_bubble"),
        (["train.grad_accum=0"], {}, "grad_accum"),
        (["strategy=zero3"], {}, "strategy"),
        (["data.corpus=/nonexistent/corpus"], {}, "make_corpus"),
        (["train.max_steps=0"], {}, "max_steps"),
        (["compile=true", "compile_backend=inductr"], {}, "not a torch.compile backend"),
        (["eval.interval=5", "eval.split=heldout"], {}, "cuts_heldout.jsonl.gz does not exist"),
    ],
)
def test_bad_configs_stop_before_training(tmp_path, corpus, overrides, env, message, monkeypatch):
    """Each refusal is one ConfigError line from ``preflight``, which runs before any process
    group or model exists (checked in this process: the command's side is the test below)."""
    for name, value in {"WORLD_SIZE": "1", **env}.items():
        monkeypatch.setenv(name, value)
    cfg = compose_training_config(
        [f"run_dir={tmp_path / 'run'}", f"data.corpus={corpus}", *overrides]
    )
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        preflight(cfg)
    assert "\n" not in str(refused.value)


def test_a_refused_config_exits_2_with_one_error_line_and_trains_nothing(tmp_path, corpus):
    """What the chain's hook reads: exit 2, one ``error:`` line, an end record, no checkpoint."""
    run_dir = tmp_path / "run"
    overrides = ("parallel.pp=2", "parallel.pp_microbatches=1")
    job = {"SLURM_JOB_ID": "77", "ORCH_JOB_INDEX": "0"}
    completed = train(run_dir, corpus, *overrides, nproc=2, env=job, check=False)
    assert completed.returncode == 2, completed.stderr
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "fewer than pp" in errors[0], completed.stderr[-2000:]
    record = read_job_end(run_dir, "0", "77")
    assert record is not None and (record["reason"], record["exit_code"]) == ("error", 2)
    assert f"error: {record['error']}" == errors[0]  # what the chain's status shows
    assert not (run_dir / "checkpoints").exists()


def test_unknown_config_key_is_refused():
    with pytest.raises(ConfigCompositionException, match="learning_rate"):
        compose_training_config(["optim.learning_rate=1"])


def read_hashes(run_dir: Path) -> dict[int, list[dict]]:
    by_rank = {}
    for path in sorted((run_dir / "batch_hashes").glob("rank*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        by_rank[rows[0]["rank"]] = rows
    return by_rank


@pytest.mark.slow
def test_seed_contract_from_batch_hashes(tmp_path, corpus):
    """dp_shard 2 x tp 2: equal within TP groups, different across DP ranks and across seeds."""
    seeds = {"a": 11, "a_again": 11, "b": 12}
    runs = {name: tmp_path / name for name in seeds}
    common = ("train.max_steps=2", "debug.batch_hashes=true")
    args = {runs[name]: (f"seed={seed}", *common) for name, seed in seeds.items()}
    train_together(args, corpus, nproc=4, config="tiny_tp")
    hashes = {name: read_hashes(run_dir) for name, run_dir in runs.items()}
    a = hashes["a"]
    assert sorted(a) == [0, 1, 2, 3]
    for step in range(2):
        by_dp: dict[int, set[str]] = {}
        for rank in a:
            row = a[rank][step]
            assert row["step"] == step + 1
            by_dp.setdefault(row["coords"]["dp_rank"], set()).add(row["hash"])
        assert all(len(group) == 1 for group in by_dp.values()), "TP peers differ"
        assert len(set.union(*by_dp.values())) == 2, "data-parallel ranks read the same batch"
    digest = {
        name: [[r["hash"] for r in h[rank]] for rank in sorted(h)] for name, h in hashes.items()
    }
    assert digest["a"] == digest["a_again"]
    assert all(x != y for x, y in zip(digest["a"], digest["b"], strict=True))


# The module's chains on the loopback cluster, by test: jobs, recipe and overrides.
CHAINS = {
    "test_pipeline_chain_across_two_nodes": (
        2,
        "recipes/train_tiny_pp_2node.yaml",
        ("train.max_steps=4", "train.max_steps_per_run=2", "train.grad_accum=2"),
    ),
    "test_context_parallel_chain_resumes": (
        2,
        "recipes/train_tiny_long_cp.yaml",
        ("train.max_steps=2", "train.max_steps_per_run=1"),
    ),
}


@pytest.fixture(scope="module")
def chains(
    request: pytest.FixtureRequest, slurm_cluster, tmp_path_factory, corpus
) -> dict[str, tuple[Path, str]]:
    """The chains of the tests selected in this session (batch hashes on), all submitted at
    once: the cluster runs them side by side (the pipeline's two nodes x 1 rank beside CP's
    node x 2 ranks), so that their jobs' start-ups and SLURM's waits between jobs overlap.
    Each test waits for its own: run dir and chain id by test name."""
    selected = {
        item.originalname for item in request.session.items if item.module is request.module
    }
    launched = {}
    for name, (jobs, recipe, overrides) in CHAINS.items():
        if name in selected:
            run_dir = tmp_path_factory.mktemp(name) / "run"
            summary = launch_training(
                jobs, run_dir, recipe, corpus, *overrides, "debug.batch_hashes=true"
            )
            launched[name] = (run_dir, summary["chain_id"])
    return launched


@pytest.mark.slurm
@pytest.mark.slow
def test_pipeline_chain_across_two_nodes(chains):
    """2 jobs of pp=2 over the loopback cluster's two nodes, 2 steps of 2 accumulated batches
    each, the second resuming the first: the startup line names each stage's blocks, both stages
    read the same batches (hashes with their pp coordinate), and the loss comes back from the
    last stage."""
    run_dir, chain = chains["test_pipeline_chain_across_two_nodes"]
    final = wait_chain(chain, timeout=400)
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 2, final
    assert final["jobs"][0]["nodes"] == "n[1-2]"
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 5))
    assert [row["job_index"] for row in rows] == [0, 0, 1, 1]
    assert all(math.isfinite(row["loss"]) and 0 < row["loss"] < 20 for row in rows)
    assert all(row["tokens_per_s"] > 0 for row in rows)
    logs = run_tool("orchestrator", "logs", chain).stdout
    assert "stage 0 on pp rank 0: encoder+projector+embeddings, blocks 0-0" in logs
    assert "stage 1 on pp rank 1: blocks 1-1, norm+head+loss" in logs
    assert f"resumed from {run_dir}/checkpoints/step_2 at step 2" in logs
    hashes = read_hashes(run_dir)
    assert [row["coords"]["pp"] for row in (hashes[0][0], hashes[1][0])] == [0, 1]
    assert [r["hash"] for r in hashes[0]] == [r["hash"] for r in hashes[1]]
    assert len({r["hash"] for r in hashes[0]}) == 4, "each step reads new batches"


@pytest.mark.slurm
@pytest.mark.slow
def test_context_parallel_chain_resumes(chains):
    """2 jobs of one step each in the long-audio recipe's cp=2 layout (here on the short corpus,
    for time): the second resumes the first; both CP ranks read the same batches, cut
    differently."""
    run_dir, chain = chains["test_context_parallel_chain_resumes"]
    final = wait_chain(chain, timeout=400)
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 2, final
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["loss"]) for row in rows)
    logs = run_tool("orchestrator", "logs", chain).stdout
    assert "cp=2" in logs
    assert f"resumed from {run_dir}/checkpoints/step_1 at step 1" in logs
    hashes = read_hashes(run_dir)
    assert [hashes[rank][0]["coords"]["cp"] for rank in (0, 1)] == [0, 1]
    assert [r["hash"] for r in hashes[0]] == [r["hash"] for r in hashes[1]]


@pytest.mark.slow
def test_single_process_checkpoint_resumes_on_two_ranks(tmp_path, corpus):
    """One process trains a plain module; two FSDP2 ranks continue from its checkpoint. The
    data-parallel size changed under the same seed, so the data restarts at the next epoch, as
    the job asks (a position of one rank means nothing to two)."""
    run_dir = tmp_path / "run"
    train(run_dir, corpus, "seed=3", "train.max_steps=2", "train.max_steps_per_run=1")
    restart = "data.on_layout_change=restart_epoch"
    resumed = train(run_dir, corpus, "seed=3", "train.max_steps=2", restart, nproc=2)
    assert f"resumed from {run_dir}/checkpoints/step_1 at step 1" in resumed.stderr
    assert "(data-parallel size 1 -> 2): starting data epoch 1" in resumed.stderr
    assert [row["step"] for row in metrics(run_dir)] == [1, 2]


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_then_end_the_job(tmp_path, corpus):
    """A NaN gradient (on one rank) skips the step on every rank and is counted; five in a row
    end the job with exit 3 and one error line, nothing non-finite is saved, and the next job
    resumes from the last checkpoint and finishes."""
    run_dir = tmp_path / "run"
    common = ("train.max_steps=8", "checkpoint.interval=2", "checkpoint.keep=10")
    poisoned = "debug.inject_nonfinite_steps=[3,4,5,6,7]"
    first = train(run_dir, corpus, *common, poisoned, nproc=2, check=False)
    assert first.returncode == 3, first.stderr[-3000:]
    errors = [line for line in first.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "5 consecutive steps up to step 7" in errors[0], errors
    rows = metrics(run_dir)
    assert [row["nonfinite_steps"] for row in rows] == [0, 0, 1, 2, 3, 4]
    assert all(row["grad_norm"] is None for row in rows[2:]), rows  # NaN is written as null
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved == [2, 4, 6], saved
    # Skipped steps leave the weights as they were: step 6 holds step 2's weights, finite.
    at_2, at_6 = final_weights(run_dir, 2, tmp_path), final_weights(run_dir, 6, tmp_path)
    for name, weight in at_2.items():
        assert torch.isfinite(weight).all(), name
        assert torch.equal(weight, at_6[name]), name

    second = train(run_dir, corpus, *common, nproc=2)
    assert "resumed from" in second.stderr and "step_6" in second.stderr
    rows = metrics(run_dir)
    assert rows[-1]["step"] == 8 and math.isfinite(rows[-1]["loss"])
    assert rows[-1]["nonfinite_steps"] == 4  # steps 3-6, as saved at step 6; step 7 was redone
