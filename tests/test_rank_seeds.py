"""The job seed reaches every random draw of a training rank, not only the data order.

Dropout (LoRA's here, ``model.lora.dropout=0.5`` on the ``tiny`` preset) draws from the rank's
own generators. Each in-process case trains on one real batch of the corpus, the same batch at
every step, so the only thing that can make two runs differ is what dropout draws: before the
rank was seeded, torch seeded its generator from the operating system at every process start,
and the same seed twice diverged at the second step (5.4334 against 5.4446). LoRA's ``B`` starts
at zero, so the first step's loss is the same whatever the masks; from the second on it is not.

The layouts (one ``torchrun`` of 2 ranks, tests/harness/workers/rank_draws_worker.py): at FSDP2
the two data-parallel ranks, fed one batch, draw different masks; at TP2 the peers, which hold
the same activations, draw the same masks, and at CP2 the peers draw each mask from the same
generator state; pipeline stages start from different states.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.harness.training import run_ranks, trainer_in_process
from train.models.init import canonical_name
from train.parallel.dims import AC_MODES, ParallelDims
from train.seeding import rank_generator_seed
from train.trainer import Trainer

DROPOUT = ("model.lora.rank=4", "model.lora.dropout=0.5", "optim.warmup_steps=1")
STEPS = 3


@pytest.fixture(scope="module")
def batch(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The first batch of the corpus as the trainer reads it: several utterances of different
    lengths."""
    run_dir = tmp_path_factory.mktemp("batch") / "run"
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first = next(trainer_in_process(run_dir, corpus, "seed=1").data.batches())
    finally:
        dist.destroy_process_group()
    assert len(set(first["feature_lens"].flatten().tolist())) > 1
    return first


def train_on(trainer: Trainer, batch: dict, steps: int = STEPS) -> list[float]:
    """The losses of ``steps`` training steps on ``batch``, each read back as a sync step does."""
    losses = []
    for _ in range(steps):
        trainer.train_step([batch])
        trainer.step += 1
        losses.append(trainer.read_back(stop_flag=0.0).loss)
    return losses


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The parameters by the names a plain model gives them (no checkpoint wrappers)."""
    return {canonical_name(n): p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_a_ranks_generator_seed_is_shared_by_tp_and_cp_peers_only() -> None:
    dims = ParallelDims(world_size=16, pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2, ep=1)
    seeds: dict[tuple[int, int], set[int]] = {}
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        seed = rank_generator_seed(7, coords.dp_rank, coords.pp)
        seeds.setdefault((coords.pp, coords.dp_rank), set()).add(seed)
    # 4 peers (cp x tp) per (stage, data-parallel rank) share one seed; the 4 groups differ.
    assert all(len(group) == 1 for group in seeds.values())
    assert len({seed for group in seeds.values() for seed in group}) == len(seeds) == 4
    assert rank_generator_seed(7, 0, 0) != rank_generator_seed(8, 0, 0)
    assert rank_generator_seed(7, 0, 0) < 2**31


def test_dropout_draws_from_the_job_seed(
    corpus: Path, batch: dict, one_rank_group: None, tmp_path: Path
) -> None:
    runs = {
        name: train_on(trainer_in_process(tmp_path / name, corpus, f"seed={seed}", *DROPOUT), batch)
        for name, seed in (("first", 1), ("again", 1), ("other", 2))
    }
    assert runs["again"] == runs["first"], runs
    assert runs["other"][0] == runs["first"][0]  # LoRA's B is zero: no mask matters yet
    assert runs["other"][1:] != runs["first"][1:], runs


def test_a_resumed_job_draws_on_with_its_seed_and_anew_with_another(
    corpus: Path, batch: dict, one_rank_group: None, tmp_path: Path
) -> None:
    """A chain's next job with the checkpoint's seed continues the saved generators (a run cut
    in two trains as one run); a new seed draws anew, as it reads a new data order."""
    whole = train_on(trainer_in_process(tmp_path / "whole", corpus, "seed=1", *DROPOUT), batch, 4)
    first = trainer_in_process(tmp_path / "cut", corpus, "seed=1", *DROPOUT)
    assert train_on(first, batch, 2) == whole[:2]
    first.save()
    first.finalize_save(wait=True)
    shutil.copytree(tmp_path / "cut", tmp_path / "reseeded")

    same = trainer_in_process(tmp_path / "cut", corpus, "seed=1", *DROPOUT)
    assert same.step == 2
    assert train_on(same, batch, 2) == whole[2:]
    other = trainer_in_process(tmp_path / "reseeded", corpus, "seed=2", *DROPOUT)
    assert other.step == 2
    assert train_on(other, batch, 2) != whole[2:]


def test_activation_checkpointing_recomputes_with_the_forwards_masks(
    corpus: Path, batch: dict, one_rank_group: None, tmp_path: Path
) -> None:
    """The recompute of a checkpointed block draws the masks of its forward again: the gradients,
    hence the losses and weights after each step, are those of no checkpointing."""
    trained = {}
    for mode in AC_MODES:
        trainer = trainer_in_process(
            tmp_path / mode, corpus, "seed=3", f"activation_checkpointing={mode}", *DROPOUT
        )
        trained[mode] = (train_on(trainer, batch), weights(trainer))
    losses, reference = trained["none"]
    for mode in AC_MODES[1:]:
        assert trained[mode][0] == losses, (mode, trained[mode][0], losses)
        for name, value in trained[mode][1].items():
            assert torch.equal(value, reference[name]), (mode, name)


LAYOUTS = {
    "fsdp2": ("tiny_fsdp2", ["parallel.dp_shard=2"]),
    "tp2": ("tiny_tp", ["parallel.dp_shard=1", "parallel.tp=2"]),
    "cp2": ("tiny_fsdp2", ["parallel.dp_shard=1", "parallel.cp=2"]),
    "pp2": ("tiny_pp", []),
}


def test_ranks_draw_apart_across_data_parallel_ranks_and_stages_alike_across_peers(
    corpus: Path, tmp_path: Path
) -> None:
    runs = [
        {
            "config": config,
            "overrides": [
                f"run_dir={tmp_path / name}",
                f"data.corpus={corpus}",
                "data.max_duration=8",
                "wandb.enabled=false",
                "seed=4",
                *DROPOUT,
                *overrides,
            ],
        }
        for name, (config, overrides) in LAYOUTS.items()
    ]
    spec, out = tmp_path / "spec.json", tmp_path / "draws.jsonl"
    spec.write_text(json.dumps({"runs": runs}))
    run_ranks(["-m", "tests.harness.workers.rank_draws_worker", str(spec), str(out)], nproc=2)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_layout = {
        name: sorted((r for r in rows if r["run"] == index), key=lambda r: r["rank"])
        for index, name in enumerate(LAYOUTS)
    }
    fsdp, tp, cp, pp = (by_layout[name] for name in LAYOUTS)
    assert fsdp[0]["generator"] != fsdp[1]["generator"]
    assert fsdp[0]["masks"] and fsdp[0]["masks"] != fsdp[1]["masks"]
    assert tp[0]["generator"] == tp[1]["generator"]
    assert tp[0]["masks"] and tp[0]["masks"] == tp[1]["masks"]
    # CP peers hold different positions of each sequence: each mask is drawn from one state.
    assert cp[0]["generator"] == cp[1]["generator"]
    assert cp[0]["states"] and cp[0]["states"] == cp[1]["states"]
    assert pp[0]["generator"] != pp[1]["generator"]
