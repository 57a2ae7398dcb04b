"""No host syncs in a training step: the forward, backward, clipping and optimizer of the
trainer's own step, on real corpus batches, on every rank, read no tensor value back and wait
for no copy (on a GPU each stalls the CPU until the device catches up). Expert parallelism's
split sizes are the one exemption (``train.models.moe.host_split_sizes``), counted apart.
What the recorder sees on a CPU, and what it cannot: tests/harness/workers/host_sync_worker.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.harness.process import REPO, run_python
from tests.harness.workers.host_sync_worker import HostReads, mark_host

WORKER = REPO / "tests" / "harness" / "workers" / "host_sync_worker.py"
STEPS = 3
RANKS = 2


def test_the_recorder_sees_every_kind_of_read():
    t = torch.tensor([1.5, 2.0])
    mask = torch.tensor([True, False])
    lens = torch.tensor([3, 4])  # the batch's lengths: on the host by design
    mark_host(lens)
    with HostReads() as recorder:
        t.sum().item(), int(t[0]), bool(t[1] > 1), t.tolist(), t.cpu(), t.numpy()
        t.nonzero(), t[mask], t.masked_select(mask), torch.unique(lens.mul(t.long()))
        torch.repeat_interleave(lens.mul(t.long())), torch.equal(t, t), lens.clone().copy_(t)
        lens.to(t.device)
        t.mul(2).sum()  # device work reads nothing
        torch.repeat_interleave(t.long(), output_size=3)  # its size known on the host
        host = lens * 2 + 1  # host work on host tensors is no sync
        host.tolist(), int(host.max()), host[host > 8], host.cpu().numpy()
        moved = host.to(t.device, non_blocking=True)  # on the device now: reading it syncs
        moved.tolist()
    kinds = [read.split(": ")[-1] for read in recorder.reads]
    assert kinds == [
        "_local_scalar_dense",
        "_local_scalar_dense",
        "_local_scalar_dense",
        "tolist",
        "cpu",
        "numpy",
        "nonzero",
        "index",
        "masked_select",
        "_unique2",
        "repeat_interleave",
        "equal",
        "copy_",
        "to(device) without non_blocking",
        "tolist",
    ], recorder.reads
    assert all(read.startswith("tests/test_host_syncs.py:") for read in recorder.reads)
    assert recorder.deliberate == []


@pytest.mark.parametrize(
    ("preset", "layout", "reads_per_step"),
    [("tiny", [], 0), ("tiny_moe", ["--ep", "2"], 2)],
    ids=["fsdp2", "moe_ep2"],
)
def test_a_training_step_reads_nothing_back(corpus, tmp_path, preset, layout, reads_per_step):
    command = [str(WORKER), "--corpus", str(corpus), "--preset", preset, *layout]
    command += ["--steps", str(STEPS), "--out", str(tmp_path)]
    result = run_python(command, RANKS, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    assert [got["reads"] for got in ranks] == [[]] * RANKS, [got["reads"] for got in ranks]
    # One read of the split sizes per MoE layer and forward under EP: 2 layers in tiny_moe.
    for got in ranks:
        assert len(got["deliberate"]) == STEPS * reads_per_step, got["deliberate"]
    sizes = [size for got in ranks for size in got["batch_sizes"]]
    assert len(set(sizes)) > 1, sizes  # real batches: their shapes vary
    # Positive controls: the gradient norm read back in the step is recorded at its site, and
    # the trainer's guard (CUDA's error mode stood in for) fails the step once warmed up.
    planted = "train/trainer.py:{} train_step: _local_scalar_dense"
    for got in ranks:
        [read] = got["planted_reads"]
        assert read == planted.format(read.split(":")[1].split()[0]), read
        assert got["guard_error"] == f"called a synchronizing operation: {read}"
        assert got["modes"] == ["error", "default"]
