"""Checkpoints: resharding across layouts, atomic saves, torn directories, state round trips.

The layout tests run tests/checkpoint_worker.py under torchrun (gloo, CPU): the tiny SALM trains
3 AdamW steps at FSDP2 x TP 2x2 and is saved, then loaded at 2x2, at FSDP2 4x1 and into one
plain process. Loaded parameters must equal the saved ones bitwise. One more step from the loaded
state must match one more step from the in-memory state: exactly enough at the same layout, and
within the tolerance of tests/test_parallel_equivalence.py elsewhere (the step's gradients are
summed in another order). An optimizer state that failed to load would move parameters by ~lr.
The other tests run the manager in this process, with no process group and with a group of one.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from train.checkpoint import MARKER, CheckpointError, CheckpointManager

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "checkpoint_worker.py"
RTOL, ATOL = 1e-5, 1e-6
NOT_RESTORED = "RNG states not restored"
TRAINER_STATE = {
    "step": 3,
    "tokens_seen": 1234567,
    "wandb_run_id": "abc123xy",
    "data": {"epoch": 1, "batch_in_epoch": 17, "data_seed": 2024},
}


def _worker(*args: str, world: int) -> subprocess.CompletedProcess[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    command = [sys.executable, *(launcher if world > 1 else []), str(WORKER), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-4000:]}"
    return result


def _save_run(tmp_path_factory, name: str, *layout: str, world: int) -> tuple[Path, dict]:
    """Train and save under ``layout``: the run dir and what the worker recorded."""
    directory = tmp_path_factory.mktemp(name)
    out = directory / "saved.pt"
    _worker("save", *layout, "--run-dir", str(directory / "run"), "--out", str(out), world=world)
    return directory / "run", torch.load(out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A 2x2 (FSDP x TP) run saved once for the module."""
    return _save_run(tmp_path_factory, "saved", "--dp-shard", "2", "--tp", "2", world=4)


def _assert_loaded(want: dict, got: dict, *, same_layout: bool) -> None:
    assert got["trainer_state"] == TRAINER_STATE
    assert got["lr"] == want["lr"]
    assert got["params"].keys() == want["params"].keys()
    for name, param in want["params"].items():
        assert torch.equal(got["params"][name], param), f"{name} differs from the saved weights"
    moved = max((want["params_after_step"][n] - p).abs().max() for n, p in want["params"].items())
    assert moved > 100 * ATOL, "the step after saving did not move the parameters"
    for name, param in want["params_after_step"].items():
        torch.testing.assert_close(
            got["params_after_step"][name],
            param,
            rtol=0 if same_layout else RTOL,
            atol=0 if same_layout else ATOL,
            msg=lambda m, name=name: f"{name} after one more step: {m}",
        )


@pytest.mark.slow
def test_reload_at_the_same_layout_continues_exactly(saved):
    run_dir, result = saved
    assert Path(result["path"]) == run_dir / "checkpoints" / "step_3"
    _assert_loaded(result, result["reloaded"], same_layout=True)
    assert result["reloaded"]["draws"] == result["draws"], "RNG states were not restored"
    assert len({str(d) for d in result["draws"]}) == 4, "ranks should hold different RNG states"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp4", "one_process"])
def test_loads_under_another_layout(saved, layout, tmp_path):
    run_dir, want = saved
    out = tmp_path / "loaded.pt"
    if layout == "fsdp4":
        completed = _worker("load", "--dp-shard", "4", "--run-dir", str(run_dir),
                            "--out", str(out), world=4)  # fmt: skip
    else:
        completed = _worker("load", "--run-dir", str(run_dir), "--out", str(out), world=1)
    got = torch.load(out)
    _assert_loaded(want, got, same_layout=False)
    if layout == "fsdp4":
        assert got["draws"] == want["draws"], "same world size: each rank restores its own RNG"
        assert NOT_RESTORED not in completed.stderr
    else:
        assert got["draws"][0] != want["draws"][0]
        assert completed.stderr.count(NOT_RESTORED) == 1, completed.stderr


@pytest.fixture(scope="module")
def saved_pp(tmp_path_factory) -> tuple[Path, dict]:
    """A pipeline run (pp 2 x dp_shard 2) saved once for the module."""
    return _save_run(tmp_path_factory, "saved_pp", "--pp", "2", "--dp-shard", "2", world=4)


@pytest.mark.slow
def test_pipeline_checkpoint_reloads_at_its_layout(saved_pp):
    _, result = saved_pp
    _assert_loaded(result, result["reloaded"], same_layout=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "args", "world"),
    [
        ("dp4", ["--dp-shard", "4"], 4),
        ("one_process", [], 1),
        ("pp2", ["--pp", "2", "--dp-shard", "1"], 2),
    ],
)
def test_pipeline_checkpoint_reshards(saved_pp, layout, args, world, tmp_path):
    """Saved by two stages of two FSDP ranks each: loads without stages, and at pp 2 alone."""
    run_dir, want = saved_pp
    out = tmp_path / "loaded.pt"
    _worker("load", *args, "--run-dir", str(run_dir), "--out", str(out), world=world)
    _assert_loaded(want, torch.load(out), same_layout=False)


@pytest.mark.slow
def test_a_data_parallel_checkpoint_loads_into_pipeline_stages(saved, tmp_path):
    run_dir, want = saved
    out = tmp_path / "loaded.pt"
    _worker("load", "--pp", "2", "--dp-shard", "1", "--run-dir", str(run_dir), "--out",
            str(out), world=2)  # fmt: skip
    _assert_loaded(want, torch.load(out), same_layout=False)


@pytest.fixture(scope="module")
def saved_cp(tmp_path_factory) -> tuple[Path, dict]:
    """A context-parallel run (cp 2 x dp_shard 2) saved once for the module."""
    return _save_run(tmp_path_factory, "saved_cp", "--cp", "2", "--dp-shard", "2", world=4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "args", "world"), [("dp4", ["--dp-shard", "4"], 4), ("one_process", [], 1)]
)
def test_context_parallel_checkpoint_reshards(saved_cp, layout, args, world, tmp_path):
    """CP holds no parameters of its own: its checkpoint loads anywhere, steps continuing."""
    run_dir, want = saved_cp
    _assert_loaded(want, want["reloaded"], same_layout=True)
    out = tmp_path / "loaded.pt"
    _worker("load", *args, "--run-dir", str(run_dir), "--out", str(out), world=world)
    _assert_loaded(want, torch.load(out), same_layout=False)


@pytest.fixture(params=["no_group", "group_of_one"])
def world_of_one(request):
    """Runs a test as a plain process, or inside a gloo process group of one rank."""
    if request.param == "group_of_one":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _training_objects(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler) -> None:
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _save(manager: CheckpointManager, step: int, seed: int = 0) -> Path:
    model, optimizer, scheduler = _training_objects(seed)
    _train_step(model, optimizer, scheduler)
    return manager.save(step, model, optimizer, scheduler, {"step": step})


def _draws() -> list:
    return [torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random()]


def test_round_trip_in_one_process(world_of_one, tmp_path):
    manager = CheckpointManager(tmp_path)
    model, optimizer, scheduler = _training_objects(seed=1)
    for _ in range(2):
        _train_step(model, optimizer, scheduler)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    path = manager.save(2, model, optimizer, scheduler, TRAINER_STATE)
    want = _draws()

    fresh, fresh_optimizer, fresh_scheduler = _training_objects(seed=2)
    random.seed(4), np.random.seed(4), torch.manual_seed(4)
    assert manager.latest() == path
    assert manager.load(path, fresh, fresh_optimizer, fresh_scheduler) == TRAINER_STATE
    assert _draws() == want
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    for key, value in optimizer.state_dict()["state"].items():
        for name, tensor in value.items():
            assert torch.equal(fresh_optimizer.state_dict()["state"][key][name], tensor), name

    weights_only, _, _ = _training_objects(seed=5)
    assert manager.load(path, weights_only, None, None) == TRAINER_STATE
    assert torch.equal(weights_only[0].weight, model[0].weight)


def test_latest_skips_torn_checkpoints_with_a_warning(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    assert manager.latest() is None
    _save(manager, 1)
    complete = _save(manager, 2)
    torn_step = tmp_path / "checkpoints" / "step_9"
    torn_step.mkdir()
    (torn_step / ".metadata").write_text("half written")
    leftover = tmp_path / "checkpoints" / ".tmp-step_10-dead"
    leftover.mkdir()
    with caplog.at_level(logging.WARNING, logger="train.checkpoint"):
        assert manager.latest() == complete
    assert str(torn_step) in caplog.text and str(leftover) in caplog.text
    with pytest.raises(CheckpointError, match=f"{torn_step}.*no {MARKER} marker"):
        manager.load(torn_step, *_training_objects(0))


def test_keep_prunes_old_checkpoints_and_stale_leftovers(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for name in (".tmp-step_2-dead", "step_1", ".tmp-step_7-dead"):
        (checkpoints / name).mkdir()
    for step in (2, 3, 4):
        _save(manager, step)
    assert sorted(p.name for p in checkpoints.iterdir()) == [".tmp-step_7-dead", "step_3", "step_4"]
    _save(manager, 8)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_4", "step_8"]


def test_a_saved_step_is_not_overwritten(world_of_one, tmp_path):
    manager = CheckpointManager(tmp_path)
    first = _save(manager, 5, seed=1)
    marker_time = (first / MARKER).stat().st_mtime_ns
    assert _save(manager, 5, seed=2) == first
    assert (first / MARKER).stat().st_mtime_ns == marker_time
    model, _, _ = _training_objects(seed=3)
    manager.load(first, model, None, None)
    original, _, _ = _training_objects(seed=1)
    assert not torch.equal(model[0].weight, original[0].weight), "the saved weights were trained"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_5"]


def test_a_torn_directory_of_the_same_step_is_replaced(tmp_path):
    manager = CheckpointManager(tmp_path)
    torn = tmp_path / "checkpoints" / "step_4"
    torn.mkdir(parents=True)
    (torn / "junk").write_text("from a crashed copy")
    assert _save(manager, 4) == torn
    assert (torn / MARKER).is_file() and not (torn / "junk").exists()
    assert manager.latest() == torn


def test_unreadable_checkpoints_name_their_path(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = _save(manager, 1)
    other_shape = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with pytest.raises(CheckpointError, match=f"cannot load checkpoint {path}: Size mismatch"):
        manager.load(path, other_shape, None, None)
    next(path.glob("*.distcp")).unlink()
    with pytest.raises(CheckpointError, match=f"cannot load checkpoint {path}: "):
        manager.load(path, *_training_objects(0))
    (path / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"cannot load checkpoint {path}: unreadable"):
        manager.load(path, *_training_objects(0))


def test_trainer_state_must_be_json(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="JSON-serialisable"):
        manager.save(1, *_training_objects(0), {"started": object()})
    assert manager.latest() is None


def test_a_checkpoint_with_list_style_optimizer_state_still_loads(tmp_path):
    """Checkpoints written before pipeline parallelism keep the optimizer's param groups as
    lists; a resumed run must still read them (and every new save is flattened)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer, scheduler = _training_objects(seed=0)
    _train_step(model, optimizer, scheduler)
    old = tmp_path / "checkpoints" / "step_1"
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()},
        checkpoint_id=old,
    )
    # Saved by another world size, so no per-rank RNG file is looked for.
    (old / "state.json").write_text('{"step": 1, "world_size": 2, "trainer_state": {}}')
    (old / MARKER).write_text("done\n")
    fresh_model, fresh_optimizer, fresh_scheduler = _training_objects(seed=1)
    CheckpointManager(tmp_path).load(old, fresh_model, fresh_optimizer, fresh_scheduler)
    for saved, loaded in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(saved, loaded)
    want = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], want)
