"""Checkpoints: resharding across layouts, atomic saves, torn directories, state round trips.

The layout tests run tests/harness/workers/checkpoint_worker.py as gloo ranks on CPU
(``_worker`` forks them as torchrun's ranks): the tiny SALM trains 3 AdamW steps at FSDP2 x TP
2x2 and is saved, then loaded at 2x2, at FSDP2 4x1 and into one plain process. Loaded parameters
must equal the saved ones bitwise. One more step from the loaded state must match one more step
from the in-memory state: exactly enough at the same layout, and within the tolerance of
tests/test_trainer_equivalence.py elsewhere (the step's gradients are summed in another order).
An optimizer state that failed to load would move parameters by ~lr. A load into one plain
process runs the worker's own load in this process (``_load_here``: no process group, as
``python tests/harness/workers/checkpoint_worker.py load`` runs it), which spares a torch
start-up per load. The other tests run the manager in this process, with no process group and
with a group of one.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict

from contract.run_dir import MARKER
from tests.harness.disk import fill_disk, tmpfs
from tests.harness.process import REPO, kill_tree, run_python
from tests.harness.training import metrics, train, train_together
from train.checkpoint import manager as checkpoint
from train.checkpoint.hyperparameters import expanded, shared, to_load
from train.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    CheckpointSaveError,
    NonFiniteState,
)
from train.checkpoint.pauses_for_tests import PAUSE_ENV, PAUSED_SUFFIX, WRITE_PAUSE_PREFIX

WORKER = REPO / "tests" / "harness" / "workers" / "checkpoint_worker.py"
# Seconds an async save's write is held while training goes on: steps 3 and 4 of the tiny model
# took up to 4 s each on a 2-core machine loaded by other runs.
WRITE_HOLD_S = 12
RTOL, ATOL = 1e-5, 1e-6
NOT_RESTORED = "RNG states not restored"
TRAINER_STATE = {
    "step": 3,
    "tokens_seen": 1234567,
    "wandb_run_id": "abc123xy",
    "data": {"epoch": 1, "batch_in_epoch": 17, "data_seed": 2024},
}


def _worker(*args: str, world: int, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``checkpoint_worker.py ARGS`` as ``world`` (> 1) ranks of one gloo group, forked from
    the test process's zygote (tests/harness/process.py). A rank that fails stops the others and
    fails the test with every rank's stderr."""
    assert world > 1, "one plain process: _load_here"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    completed = run_python([str(WORKER), *args], world, env, timeout=timeout)
    assert completed.returncode == 0, (
        f"{completed.args} on {world} ranks\n{completed.stderr[-4000:]}"
    )
    return completed


@contextlib.contextmanager
def _as_a_plain_worker() -> Iterator[None]:
    """This process as ``checkpoint_worker.py`` runs without torchrun: no process group,
    deterministic algorithms; the global RNG states and that setting are put back after."""
    assert not dist.is_initialized(), "a process group was left initialized"
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        random.setstate(rng[0]), np.random.set_state(rng[1]), torch.set_rng_state(rng[2])


def _load_here(run_dir: Path) -> dict:
    """``checkpoint_worker.py load --run-dir RUN`` as one plain process, run in this one: the
    newest checkpoint that loads, loaded into a fresh model (leftovers removed first), and what
    the worker records of it."""
    from tests.harness.workers import checkpoint_worker

    args = argparse.Namespace(dp_shard=-1, tp=1, pp=1, cp=1, run_dir=run_dir, async_save=False)
    with _as_a_plain_worker():
        return checkpoint_worker.load_and_step(args, CheckpointManager(run_dir))


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


def _load(run_dir: Path, layout: list[str], world: int, tmp_path: Path) -> dict:
    """What the worker records of ``run_dir``'s newest checkpoint loaded at ``layout`` on
    ``world`` ranks (one: a plain process, run here)."""
    if world == 1:
        assert not layout, layout
        return _load_here(run_dir)
    out = tmp_path / "loaded.pt"
    _worker("load", *layout, "--run-dir", str(run_dir), "--out", str(out), world=world)
    return torch.load(out)


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
def test_loads_under_another_layout(saved, layout, tmp_path, caplog):
    run_dir, want = saved
    out = tmp_path / "loaded.pt"
    if layout == "fsdp4":
        completed = _worker("load", "--dp-shard", "4", "--run-dir", str(run_dir),
                            "--out", str(out), world=4)  # fmt: skip
        got = torch.load(out)
    else:
        with caplog.at_level(logging.WARNING, logger="train.checkpoint"):
            got = _load_here(run_dir)
    _assert_loaded(want, got, same_layout=False)
    if layout == "fsdp4":
        assert got["draws"] == want["draws"], "same world size: each rank restores its own RNG"
        assert NOT_RESTORED not in completed.stderr
    else:
        assert got["draws"][0] != want["draws"][0]
        assert caplog.text.count(NOT_RESTORED) == 1, caplog.text


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
        ("dp2", ["--dp-shard", "2"], 2),
        ("one_process", [], 1),
        ("pp2", ["--pp", "2", "--dp-shard", "1"], 2),
    ],
)
def test_pipeline_checkpoint_reshards(saved_pp, layout, args, world, tmp_path):
    """Saved by two stages of two FSDP ranks each: loads without stages (two FSDP ranks
    holding the whole model, or one plain process), and at pp 2 alone."""
    run_dir, want = saved_pp
    _assert_loaded(want, _load(run_dir, args, world, tmp_path), same_layout=False)


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
    ("layout", "args", "world"), [("dp2", ["--dp-shard", "2"], 2), ("one_process", [], 1)]
)
def test_context_parallel_checkpoint_reshards(saved_cp, layout, args, world, tmp_path):
    """CP holds no parameters of its own: its checkpoint (sharded over 4 ranks) loads anywhere,
    here into two FSDP ranks and into one plain process, steps continuing."""
    run_dir, want = saved_cp
    _assert_loaded(want, want["reloaded"], same_layout=True)
    _assert_loaded(want, _load(run_dir, args, world, tmp_path), same_layout=False)


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
    # The scheduler's lr and every other hyperparameter, saved once for all parameters.
    assert fresh_optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    held = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    assert "optim.hyperparameters.lr" in held
    assert not any(key.startswith("optim.param_groups.") for key in held)

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
    manager.finish()  # pruned checkpoints are deleted in the background
    assert sorted(p.name for p in checkpoints.iterdir()) == [".tmp-step_7-dead", "step_3", "step_4"]
    _save(manager, 8)
    manager.finish()
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


@pytest.mark.parametrize(
    "options",
    [None, checkpoint.FLAT_OPTIMIZER],
    ids=["param-groups-as-lists", "hyperparameters-per-parameter"],
)
def test_a_checkpoint_of_an_older_optimizer_format_still_loads(tmp_path, options):
    """Checkpoints written before pipeline parallelism keep the optimizer's param groups as
    lists; those written before 2026-11-30 repeat the hyperparameters under every parameter's
    name (DCP's flattened state as it comes). A resumed run reads both as they are."""
    model, optimizer, scheduler = _training_objects(seed=0)
    _train_step(model, optimizer, scheduler)
    old = tmp_path / "checkpoints" / "step_1"
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
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
    assert fresh_optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    want = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], want)


def test_hyperparameters_are_kept_once_only_where_every_parameter_has_the_same() -> None:
    same = {"state.a.step": 1, "param_groups.a.lr": 0.1, "param_groups.b.lr": 0.1}
    assert shared(same) == {"state.a.step": 1, "hyperparameters.lr": 0.1}
    differing = {"param_groups.a.lr": 0.1, "param_groups.b.lr": 0.2}
    assert shared(differing) == differing
    tensors = {"param_groups.a.lr": torch.tensor(0.1), "param_groups.b.lr": torch.tensor(0.1)}
    assert shared(tensors) is tensors
    template = {"state.a.step": 0, "param_groups.a.lr": 1.0, "param_groups.b.lr": 1.0}
    asked = to_load(template)
    assert asked == {"state.a.step": 0, "hyperparameters.lr": 1.0}
    asked["hyperparameters.lr"], asked["state.a.step"] = 0.25, 7
    want = {"state.a.step": 7, "param_groups.a.lr": 0.25, "param_groups.b.lr": 0.25}
    assert expanded(asked, template) == want


# asynchronous saves ---------------------------------------------------------------------------


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_an_async_save_holds_the_state_of_its_step(world_of_one, tmp_path):
    """The loop moves on (here: trains) while the files are written; the checkpoint holds the
    weights of the step it was taken at, and looks complete only once finalized."""
    manager = CheckpointManager(tmp_path, async_save=True)
    model, optimizer, scheduler = _training_objects(seed=1)
    _train_step(model, optimizer, scheduler)
    saved = _params(model)
    path = manager.save(1, model, optimizer, scheduler, {"step": 1})
    assert manager.pending and not path.exists() and manager.latest() is None
    for _ in range(3):
        _train_step(model, optimizer, scheduler)
    manager.wait()
    assert not manager.pending and manager.latest() == path and (path / MARKER).is_file()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_1"]
    fresh, _, _ = _training_objects(seed=2)
    manager.load(path, fresh, None, None)
    for name, param in _params(fresh).items():
        assert torch.equal(param, saved[name]), name


def test_the_next_async_save_finalizes_the_one_in_flight(world_of_one, tmp_path):
    manager = CheckpointManager(tmp_path, keep=1, async_save=True)
    model, optimizer, scheduler = _training_objects(seed=1)
    manager.save(1, model, optimizer, scheduler, {"step": 1})
    _train_step(model, optimizer, scheduler)
    manager.save(2, model, optimizer, scheduler, {"step": 2})
    assert manager.latest().name == "step_1" and manager.pending
    manager.poll()  # one rank: finalizes once the write is done
    manager.finish()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_2"]


def _held(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> threading.Event:
    """Make ``owner.name`` (run by the background write) wait until the returned event is set."""
    original = getattr(owner, name)
    release = threading.Event()

    def held(*args, **kwargs):
        assert release.wait(60), f"{name} was never released"
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    return release


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values()]


def test_an_async_save_is_a_snapshot_of_its_moment(world_of_one, tmp_path, monkeypatch):
    """The next step changes every weight and optimizer state in place (the step count too)
    before any file is written (the write is held until then): the checkpoint still holds the
    values of the moment ``save`` was called."""
    release = _held(monkeypatch, dcp.FileSystemWriter, "write_data")
    manager = CheckpointManager(tmp_path, async_save=True)
    model, optimizer, scheduler = _training_objects(seed=1)
    _train_step(model, optimizer, scheduler)
    want_params = _params(model)
    want_optimizer = [t.clone() for t in _optimizer_tensors(optimizer)]
    path = manager.save(1, model, optimizer, scheduler, {"step": 1})
    with torch.no_grad():
        for tensor in [*model.parameters(), *_optimizer_tensors(optimizer)]:
            tensor.add_(1)
    assert manager.pending and not list(path.parent.glob(".tmp-step_1-*/*.distcp"))
    release.set()
    manager.wait()

    fresh, fresh_optimizer, _ = _training_objects(seed=2)
    manager.load(path, fresh, fresh_optimizer, None)
    for name, param in _params(fresh).items():
        assert torch.equal(param, want_params[name]), name
    got = _optimizer_tensors(fresh_optimizer)
    assert len(got) == len(want_optimizer) == 12  # step, exp_avg, exp_avg_sq of 4 tensors
    for tensor, want in zip(got, want_optimizer, strict=True):
        assert torch.equal(tensor, want)


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _tensors(value)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def test_async_saves_reuse_their_staging_buffers(world_of_one, tmp_path, monkeypatch):
    """DCP gets a CPU copy of the state in one flat buffer per dtype, the same buffer at every
    save, never the live tensors."""
    staged: list[list[torch.Tensor]] = []
    save = dcp.save

    def capture(state_dict, **kwargs):
        staged.append(_tensors(state_dict))
        return save(state_dict, **kwargs)

    monkeypatch.setattr(dcp, "save", capture)
    manager = CheckpointManager(tmp_path, async_save=True)
    model, optimizer, scheduler = _training_objects(seed=1)
    live = {
        t.untyped_storage().data_ptr()
        for t in [*model.parameters(), *_optimizer_tensors(optimizer)]
    }
    for step in (1, 2):
        _train_step(model, optimizer, scheduler)
        manager.save(step, model, optimizer, scheduler, {"step": step})
        manager.wait()
    first, second = staged
    assert len(first) == 16  # 4 parameters, each with its step and 2 moments
    assert len({t.untyped_storage().data_ptr() for t in first}) == 1, "one float32 buffer"
    assert [t.data_ptr() for t in first] == [t.data_ptr() for t in second]
    assert not live & {t.untyped_storage().data_ptr() for t in second}


# non-finite states ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["parameter", "optimizer state"])
def test_non_finite_states_are_never_saved(world_of_one, tmp_path, where):
    manager = CheckpointManager(tmp_path, keep=1)
    model, optimizer, scheduler = _training_objects(seed=1)
    _train_step(model, optimizer, scheduler)
    good = manager.save(1, model, optimizer, scheduler, {"step": 1})
    if where == "parameter":
        model[2].bias.data[0] = float("inf")
    else:
        optimizer.state[model[0].weight]["exp_avg_sq"][1, 2] = float("nan")
    refused = r"not saving checkpoint step_2: .* non-finite .*step_1 is kept"
    with pytest.raises(NonFiniteState, match=refused):
        manager.save(2, model, optimizer, scheduler, {"step": 2})
    manager.finish()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_1"]
    assert manager.latest() == good


@pytest.mark.parametrize("finalize", ["poll", "wait", "next save"])
def test_a_non_finite_async_save_is_never_completed(world_of_one, tmp_path, monkeypatch, finalize):
    """The staged copy is checked in the background: a weight that was infinite when ``save``
    was called refuses the checkpoint even if the live one is finite again before the check
    runs (held until then). The finalize raises NonFiniteState and removes the directory."""
    manager = CheckpointManager(tmp_path, keep=1, async_save=True)
    model, optimizer, scheduler = _training_objects(seed=1)
    _train_step(model, optimizer, scheduler)
    good = manager.save(1, model, optimizer, scheduler, {"step": 1})
    manager.wait()
    release = _held(monkeypatch, checkpoint, "_staged_nonfinite")
    model[2].bias.data[0] = float("inf")
    manager.save(2, model, optimizer, scheduler, {"step": 2})
    model[2].bias.data[0] = 0.0
    release.set()
    refused = (
        r"not saving checkpoint step_2: model\.2\.bias \(rank 0\) holds non-finite .*step_1 is kept"
    )
    with pytest.raises(NonFiniteState, match=refused):
        if finalize == "poll":
            for _ in range(6000):
                manager.poll()
                time.sleep(0.01)
        elif finalize == "wait":
            manager.wait()
        else:
            manager.save(3, model, optimizer, scheduler, {"step": 3})
    assert not manager.pending
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_1"]
    assert manager.latest() == good
    path = manager.save(3, model, optimizer, scheduler, {"step": 3})
    manager.finish()
    assert manager.latest() == path and [p.name for p in path.parent.iterdir()] == ["step_3"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_huge_but_finite_states_are_saved(world_of_one, tmp_path, async_save):
    """1e30 squared overflows the fast check; the element-wise one lets it through."""
    manager = CheckpointManager(tmp_path, async_save=async_save)
    model, optimizer, scheduler = _training_objects(seed=1)
    with torch.no_grad():
        model[0].weight[0, 0] = 1e30
    path = manager.save(1, model, optimizer, scheduler, {"step": 1})
    manager.finish()
    assert manager.latest() == path


# broken checkpoints ---------------------------------------------------------------------------


def test_a_checkpoint_that_fails_to_load_is_skipped_for_the_previous_one(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    model, optimizer, scheduler = _training_objects(seed=1)
    _train_step(model, optimizer, scheduler)
    first = manager.save(1, model, optimizer, scheduler, {"step": 1})
    want = _params(model)
    _train_step(model, optimizer, scheduler)
    newest = manager.save(2, model, optimizer, scheduler, {"step": 2})
    distcp = next(newest.glob("*.distcp"))
    os.truncate(distcp, distcp.stat().st_size // 2)

    fresh, fresh_optimizer, fresh_scheduler = _training_objects(seed=2)
    with caplog.at_level(logging.WARNING, logger="train.checkpoint"):
        path, state = manager.load_latest(fresh, fresh_optimizer, fresh_scheduler)
    assert (path, state) == (first, {"step": 1})
    assert "skipping checkpoint step_2: cannot load checkpoint" in caplog.text
    for name, param in _params(fresh).items():
        assert torch.equal(param, want[name]), name
    # Set aside, so that the next save of step 2 is not mistaken for done.
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names[0] == "step_1" and names[1].startswith("step_2.broken-"), names
    assert manager.latest() == first

    os.truncate(next(first.glob("*.distcp")), 10)
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* loads \(1 tried\)"):
        manager.load_latest(*_training_objects(seed=3))
    assert manager.latest() == first, "nothing loads: nothing is set aside"


def _wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def saved_twice(tmp_path_factory) -> tuple[Path, dict]:
    """Two FSDP ranks' run with checkpoints at steps 1 and 2, and its weights at each."""
    where = tmp_path_factory.mktemp("saved_twice")
    run_dir = where / "run"
    _worker("save-two", "--run-dir", str(run_dir), "--out", str(where / "saved.pt"), world=2)
    return run_dir, torch.load(where / "saved.pt")


@pytest.mark.slow
def test_all_ranks_skip_checkpoints_that_fail_on_one(tmp_path, saved_twice):
    """Two FSDP ranks, two checkpoints that each fail to load on rank 1 only: step_3 (a copy
    of step_2) for a torn data file, step_2 for its own torn RNG file. One load skips each on
    both ranks, with one warning each naming its cause, and loads step_1."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved_twice[0], run_dir)
    saved = saved_twice[1]
    checkpoints = run_dir / "checkpoints"
    shutil.copytree(checkpoints / "step_2", checkpoints / "step_3")
    torn_data = checkpoints / "step_3" / "__1_0.distcp"
    torn_rng = checkpoints / "step_2" / "rng" / "rank_00001.pt"
    for victim in (torn_data, torn_rng):
        os.truncate(victim, victim.stat().st_size // 2)

    out = tmp_path / "loaded.pt"
    completed = _worker("load", "--run-dir", str(run_dir), "--out", str(out), world=2)
    got = torch.load(out)
    first = str(checkpoints / "step_1")
    assert got["paths"] == [first, first], got["paths"]
    assert got["trainer_state"] == {"step": 1}
    for name, param in saved["params"][1].items():
        assert torch.equal(got["params"][name], param), name
    skipped = [line for line in completed.stderr.splitlines() if "skipping checkpoint" in line]
    assert len(skipped) == 2, completed.stderr[-3000:]
    data_failure, rng_failure = skipped
    assert "skipping checkpoint step_3: " in data_failure and "rng" not in data_failure, skipped
    assert "skipping checkpoint step_2: " in rng_failure and str(torn_rng) in rng_failure, skipped


@pytest.mark.slow
def test_a_kill_during_an_async_save_leaves_no_complete_checkpoint(tmp_path):
    """SIGKILL (both ranks and their launcher) while step_2 is being written in the
    background, its files already there: no step_2, and the next start (2 ranks, as the job
    saved it) removes the torn save and loads step_1 on both ranks."""
    run_dir = tmp_path / "run"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command = [sys.executable, *launcher, str(WORKER), "save-then-hang", "--async-save",
               "--run-dir", str(run_dir), "--out", str(tmp_path / "unused")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    log_file = open(tmp_path / "worker.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: all((run_dir / f"rank{r}.written").exists() for r in (0, 1)))
    finally:
        kill_tree(process)
        log_file.close()
    checkpoints = run_dir / "checkpoints"
    torn = list(checkpoints.glob(".tmp-step_2-*"))
    assert len(torn) == 1 and len(list(torn[0].glob("*.distcp"))) == 2, list(checkpoints.iterdir())
    assert not (torn[0] / MARKER).exists() and not (checkpoints / "step_2").exists()

    assert _load(run_dir, [], 2, tmp_path)["paths"] == [str(checkpoints / "step_1")] * 2
    assert [p.name for p in checkpoints.iterdir()] == ["step_1"], "the torn save is removed"


# full and read-only disks ---------------------------------------------------------------------


def _big_objects(seed: int):
    """About 0.8 MiB of checkpoint: a third of the small disk."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(3, 256)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_fails_the_save_in_one_line_and_keeps_the_previous(
    world_of_one, small_disk, async_save
):
    manager = CheckpointManager(small_disk / "run", async_save=async_save)
    disk = re.escape(str(small_disk))
    checkpoints = small_disk / "run" / "checkpoints"
    objects = _big_objects(seed=1)
    manager.save(1, *objects, {"step": 1})
    manager.finish()
    want = _params(objects[0])
    filler = fill_disk(small_disk, leave=100_000)  # the RNG file fits, the model does not

    with pytest.raises(CheckpointSaveError) as failure:
        manager.save(2, *_big_objects(seed=2), {"step": 2})
        manager.finish()
    line = str(failure.value)
    assert "\n" not in line
    assert re.fullmatch(
        rf"checkpoint step_2 not saved: no space left on device on {disk} "
        rf"\([\d.]+ (B|KiB) free\) writing {re.escape(str(checkpoints))}/\.tmp-step_2-\w+\S*; "
        "free space or "
        "move the run dir; the previous checkpoint step_1 is intact",
        line,
    ), line
    assert [p.name for p in checkpoints.iterdir()] == ["step_1"], "the torn save is removed"
    fresh = _big_objects(seed=3)[0]
    assert manager.load_latest(fresh, None, None)[0] == checkpoints / "step_1"
    for name, param in _params(fresh).items():
        assert torch.equal(param, want[name]), name

    # A job that starts on the still-full disk says so at once.
    with pytest.raises(
        CheckpointSaveError, match=f"checkpoints cannot be saved: .* free on {disk}, the last "
    ):
        manager.check_room()
    filler.unlink()
    manager.check_room()
    manager.save(3, *_big_objects(seed=3), {"step": 3})
    manager.finish()
    assert manager.latest() == checkpoints / "step_3"


def test_a_read_only_disk_is_named_at_start_and_at_save(world_of_one, small_disk):
    manager = CheckpointManager(small_disk / "run")
    disk = re.escape(str(small_disk))
    manager.save(1, *_big_objects(seed=1), {"step": 1})
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        with pytest.raises(
            CheckpointSaveError,
            match=f"checkpoints cannot be saved: read-only file system on {disk} ",
        ):
            manager.check_room()
        with pytest.raises(
            CheckpointSaveError,
            match=f"checkpoint step_2 not saved: read-only file system on {disk} .*; "
            "make it writable or move the run dir; the previous checkpoint step_1 is intact",
        ):
            manager.save(2, *_big_objects(seed=2), {"step": 2})
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    assert manager.latest() == small_disk / "run" / "checkpoints" / "step_1"


def test_leftovers_of_crashed_jobs_are_removed_at_start(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    checkpoints = tmp_path / "checkpoints"
    for name in (".tmp-step_2-dead", ".trash-step_0-dead"):
        (checkpoints / name).mkdir()
        (checkpoints / name / "__0_0.distcp").write_text("x")
    manager.remove_leftovers()
    assert [p.name for p in checkpoints.iterdir()] == ["step_1"]


# the trainer ----------------------------------------------------------------------------------


def _checkpoint_state(run_dir: Path, step: int, tmp_path: Path) -> dict:
    """Everything a checkpoint holds (model, optimizer, scheduler), as one flat dict."""
    out = tmp_path / f"{run_dir.name}-{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step}", out)
    flat: dict = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(torch.load(out, weights_only=False), "")
    return flat


def _assert_kept_whole(run_dir: Path, step: int, tmp_path: Path) -> None:
    """``step``'s checkpoint is the newest complete one, and all of it reads back, finite."""
    assert CheckpointManager(run_dir).latest() == run_dir / "checkpoints" / f"step_{step}"
    state = _checkpoint_state(run_dir, step, tmp_path)
    tensors = [value for value in state.values() if isinstance(value, torch.Tensor)]
    assert tensors and all(torch.isfinite(t).all() for t in tensors), "non-finite values saved"


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


@pytest.mark.slow
def test_async_checkpoints_train_and_resume_exactly_as_sync_ones(tmp_path, corpus, monkeypatch):
    """Two FSDP ranks: with checkpoint.async_save the losses, every checkpoint and the final
    weights are bitwise those of synchronous saves; a job resumed from a checkpoint written in
    the background while training went on (step_4) continues exactly to step 6. Step 2's write
    is held (the test hook PAUSE_ENV) while steps 3 and 4 change every weight in place: it must
    write the staged copy of step 2, not the live tensors. Its files must be younger than step
    4's metrics row, or the hold did not cover those steps and tested nothing: the test says so.

    The synchronous run and the first async job (stopped after step 5) train one after the
    other in one process group (tests/harness/workers/trainer_runs_worker.py), which starts torch
    on each rank once for both; the resumed job is a ``python -m train`` of its own."""
    common = ("seed=5", "train.max_steps=6", "checkpoint.interval=2", "checkpoint.keep=10",
              "wandb.enabled=false")  # fmt: skip
    sync, async_ = tmp_path / "sync", tmp_path / "async"
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    held = pauses / f"{WRITE_PAUSE_PREFIX}step_2"
    held.write_text(f"{WRITE_HOLD_S}\n")
    # Only an async save's background write looks for this hook: the sync run passes it by.
    with monkeypatch.context() as patch:
        patch.setenv(PAUSE_ENV, str(pauses))
        first = train_together(
            {
                sync: common,
                async_: (*common, "checkpoint.async_save=true", "train.max_steps_per_run=5"),
            },
            corpus,
            nproc=2,
        )
    assert "step_2: being written in the background" in first.stderr
    assert (
        "its staged copy not yet written" in held.with_name(held.name + PAUSED_SUFFIX).read_text()
    )
    step_4_done = next(row["time"] for row in metrics(async_) if row.get("step") == 4)
    written = min(path.stat().st_mtime for path in (async_ / "checkpoints/step_2").glob("*.distcp"))
    assert written > step_4_done, (
        f"step_2's files were written {step_4_done - written:.1f} s before step 4 ended: the "
        f"{WRITE_HOLD_S}-s hold did not cover steps 3 and 4 on this machine; raise WRITE_HOLD_S"
    )
    for step in (2, 4, 5):
        assert (async_ / "checkpoints" / f"step_{step}" / MARKER).is_file(), step
        if step != 5:
            _assert_same_state(
                _checkpoint_state(sync, step, tmp_path), _checkpoint_state(async_, step, tmp_path)
            )
    shutil.rmtree(async_ / "checkpoints" / "step_5")  # resume from the mid-run one
    second = train(async_, corpus, *common, "checkpoint.async_save=true", nproc=2)
    assert "at step 4" in second.stderr, second.stderr[-2000:]

    def losses(run_dir: Path) -> dict[int, float]:  # the last job's value of each step
        return {row["step"]: row["loss"] for row in metrics(run_dir) if "loss" in row}

    assert losses(async_) == losses(sync) and len(losses(sync)) == 6
    _assert_same_state(_checkpoint_state(sync, 6, tmp_path), _checkpoint_state(async_, 6, tmp_path))


@pytest.fixture
def disk_for_one_checkpoint(tmp_path) -> Iterator[Path]:
    """A real 8 MiB file system (tmpfs): room for one tiny-preset checkpoint (~5 MiB), not two."""
    with tmpfs(tmp_path / "disk", "8m") as disk:
        yield disk


def _errors(completed: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]
    return [line for line in completed.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("async_save", ["false", "true"], ids=["sync", "async"])
def test_a_disk_that_fills_up_ends_the_job_in_one_line(
    corpus, disk_for_one_checkpoint, async_save, tmp_path
):
    """step_2 fits, step_4 does not: the job exits 4 with one line naming the disk and step_2
    stays whole; once the disk has room again, the next job resumes from step_2 and trains to
    its end, saving as it goes. After the sync case a job on the still-full disk comes first
    and fails at once with such a line (the room check at a job's start is the same for
    checkpoint.async_save)."""
    disk, run_dir = disk_for_one_checkpoint, disk_for_one_checkpoint / "run"
    common = ("train.max_steps=8", "checkpoint.interval=2", "wandb.enabled=false",
              f"checkpoint.async_save={async_save}")  # fmt: skip
    first = train(run_dir, corpus, *common, check=False)
    assert first.returncode == 4, first.stderr[-3000:]
    errors = _errors(first)
    assert len(errors) == 1, errors
    assert re.fullmatch(
        rf"error: checkpoint step_4 not saved: no space left on device on {re.escape(str(disk))} "
        r"\([\d.]+ \w+ free\) writing \S+/\.tmp-step_4-\S+; free space or move the run dir; "
        "the previous checkpoint step_2 is intact",
        errors[0],
    ), errors[0]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_2"]
    _assert_kept_whole(run_dir, 2, tmp_path)
    if async_save == "false":
        _a_job_on_the_full_disk_fails_at_once(run_dir, corpus, common, disk)

    subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
    resumed = train(run_dir, corpus, *common, "checkpoint.keep=1")
    assert f"resumed from {run_dir}/checkpoints/step_2 at step 2" in resumed.stderr
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_8"]
    assert (run_dir / "checkpoints" / "step_8" / MARKER).is_file()
    assert [row["step"] for row in metrics(run_dir) if "loss" in row][-6:] == list(range(3, 9))


def _a_job_on_the_full_disk_fails_at_once(
    run_dir: Path, corpus: Path, common: tuple[str, ...], disk: Path
) -> None:
    second = train(run_dir, corpus, *common, check=False)
    assert second.returncode == 4, second.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_2 at step 2" in second.stderr
    assert re.fullmatch(
        rf"error: checkpoints cannot be saved: [\d.]+ \w+ free on {re.escape(str(disk))}, the "
        r"last checkpoint step_2 took [\d.]+ MiB, in \S+; free space or move the run dir",
        "\n".join(_errors(second)),
    ), _errors(second)


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_non_finite_weights_are_never_saved(tmp_path, corpus, async_save):
    """A parameter made infinite on rank 0 after step 3 (as an overflowing update would):
    step_4 is not saved on any rank, the job ends as diverged (exit 3) in one line, and step_2
    is kept, complete, and reads back finite. An async save learns it from its background check
    as the save is finalized (the next step) and ends the same way. After the sync case the
    next job resumes from step_2, trains step 3 again to the same loss and goes on to step 6
    (what follows the divergence does not depend on checkpoint.async_save)."""
    run_dir = tmp_path / "run"
    common = ("train.max_steps=6", "checkpoint.interval=2", "checkpoint.keep=1",
              "wandb.enabled=false", f"checkpoint.async_save={async_save}")  # fmt: skip
    first = train(run_dir, corpus, *common, "debug.inject_nonfinite_params=[3]", nproc=2,
                  check=False)  # fmt: skip
    assert first.returncode == 3, first.stderr[-3000:]
    errors = [line for line in first.stderr.splitlines() if line.startswith("error:")]
    learned = "5" if async_save else "4"
    assert len(errors) == 1, errors
    assert f"step {learned}: not saving checkpoint step_4: " in errors[0], errors
    assert "non-finite values" in errors[0] and "step_2 is kept" in errors[0], errors
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_2"]
    _assert_kept_whole(run_dir, 2, tmp_path)
    if async_save:
        return
    before = {row["step"]: row["loss"] for row in metrics(run_dir) if "loss" in row}

    second = train(run_dir, corpus, *common, nproc=2)
    assert f"resumed from {run_dir}/checkpoints/step_2 at step 2" in second.stderr
    after = [(row["step"], row["loss"]) for row in metrics(run_dir) if "loss" in row][-4:]
    assert [step for step, _ in after] == [3, 4, 5, 6]
    assert after[0][1] == before[3], "step 3 again from step_2 gives its first loss"
    assert all(math.isfinite(loss) for _, loss in after), after
    _assert_kept_whole(run_dir, 6, tmp_path)


def test_a_learning_rate_that_overflows_saves_nothing(tmp_path, corpus):
    """lr 1e40: step 1's gradients are finite (so it is not skipped) but its update makes the
    weights infinite; the checkpoint of step 1 is refused, the job exits 3."""
    run_dir = tmp_path / "run"
    completed = train(run_dir, corpus, "optim.lr=1e40", "train.max_steps=3",
                      "checkpoint.interval=1", "wandb.enabled=false", check=False)  # fmt: skip
    assert completed.returncode == 3, completed.stderr[-3000:]
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not saving checkpoint step_1" in errors[0], errors
    assert not list((run_dir / "checkpoints").glob("step_*"))
