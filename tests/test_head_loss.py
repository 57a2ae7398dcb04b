"""The head's cross-entropy a chunk of positions at a time (train/models/head_loss.py) gives the
loss and gradients of ``F.cross_entropy`` over ``F.linear``'s full logits, the trainer's loss
before it: at one process for every chunking (one position, uneven, whole, more than all), in
bf16 as a GPU runs it, in the model itself with LoRA adapters and with a tied head, and on a
vocabulary split over two TP ranks. The pipeline's last stage and every layout's whole step are
checked against one process by tests/test_trainer_equivalence.py. And it never holds the
logits of all positions: its peak is measured against the full logits' loss."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from tests.harness.process import REPO, run_python
from tests.harness.synthetic import synthetic_batch
from train.config import TrainConfig, validate
from train.models.build import build_model
from train.models.head_loss import head_loss
from train.models.lora import with_lora
from train.models.packing import IGNORE_INDEX
from train.models.presets import get_preset
from train.models.salm import embed_inputs

WORKER = REPO / "tests" / "harness" / "workers" / "head_loss_worker.py"


def case(dtype: torch.dtype = torch.float32, positions: int = 14, vocab: int = 37, width: int = 8):
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, positions // 2, width, generator=generator).to(dtype)
    weight = torch.randn(vocab, width, generator=generator).to(dtype)
    labels = torch.randint(0, vocab, (2, positions // 2), generator=generator)
    labels[0, :3] = IGNORE_INDEX  # a prompt's or an audio segment's positions
    return hidden, weight, labels


def reference(hidden, weight, labels):
    """The trainer's loss before: the full logits in the model's dtype, cast, summed."""
    logits = F.linear(hidden, weight).float().flatten(0, 1)
    return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def loss_and_grads(loss_fn, hidden, weight, labels):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(hidden, weight, labels)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 5, 14, 100])
def test_each_chunking_gives_the_full_logits_loss_and_gradients(chunk):
    hidden, weight, labels = case()
    want = loss_and_grads(reference, hidden, weight, labels)
    got = loss_and_grads(lambda h, w, y: head_loss(h, w, y, chunk), hidden, weight, labels)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert not got[1][0, :3].any(), "an ignored position got a gradient"


def test_bf16_as_a_gpu_runs_it():
    """bf16 hidden states and head: the same bf16 matmul per position, fp32 from the logits on;
    the head's gradient is summed over chunks in fp32 and rounded once, as one matmul rounds."""
    hidden, weight, labels = case(torch.bfloat16, positions=64, vocab=300, width=32)
    want = loss_and_grads(reference, hidden, weight, labels)
    got = loss_and_grads(lambda h, w, y: head_loss(h, w, y, 7), hidden, weight, labels)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(got[2], want[2], rtol=2e-2, atol=1e-2)


def test_under_autocast_the_head_computes_in_its_dtype():
    """ddp's bf16 on a GPU: the loss of fp32 inputs under autocast is the loss of their bf16
    casts, and their gradients come back in fp32."""
    hidden, weight, labels = case(positions=64, vocab=300, width=32)
    bf16 = [t.to(torch.bfloat16) for t in (hidden, weight)]
    want = loss_and_grads(lambda h, w, y: head_loss(h, w, y, 7), *bf16, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(lambda h, w, y: head_loss(h, w, y, 7), hidden, weight, labels)
    assert got[1].dtype == got[2].dtype == torch.float32
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1].float()) and torch.equal(got[2], want[2].float())


@pytest.mark.parametrize("shape", ["lora", "tied"])
def test_the_models_loss_is_the_full_logits_loss(shape):
    """The tiny SALM's forward (LoRA adapters on its projections, or a head tied to the
    embedding) against the logits of its own decoder's forward, and every trainable
    parameter's gradient, on a batch of four examples of varied lengths."""
    cfg = get_preset("tiny")
    if shape == "lora":
        cfg = with_lora(cfg, 4, 8.0, 0.0, ["q_proj", "v_proj", "down_proj"])
    else:
        cfg = replace(cfg, tie_embeddings=True)
    model = build_model(cfg, torch.device("cpu"), 1234)
    model.loss_chunk = 16
    batch = synthetic_batch()

    def full_logits_loss():
        x, layout = embed_inputs(model.encoder, model.projector, model.llm.embed, batch, 64)
        logits, _ = model.llm(x, layout.token_mask)
        flat = logits.float().flatten(0, 1)
        return F.cross_entropy(
            flat, layout.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    def grads(loss: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got = model(batch, seq_len=64).nll_sum
    got_grads = grads(got)
    want = full_logits_loss()
    want_grads = grads(want)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got_grads.keys() == want_grads.keys() and got_grads
    if shape == "lora":
        assert all("lora" in name or not name.startswith("llm.") for name in got_grads)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_vocabulary_split_over_tp_ranks(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_python([str(WORKER), "--out", str(tmp_path)], 2, env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads((tmp_path / "head_loss.json").read_text())
    for hidden_kind, error in results.items():
        assert error["loss_rel"] < 1e-6, (hidden_kind, error)
        assert error["hidden_grad"] < 1e-5 and error["head_grad"] < 1e-5, (hidden_kind, error)


def peak_bytes(loss_fn, hidden, weight, labels) -> int:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    tracker = MemTracker()
    tracker.track_external(hidden, weight)
    with tracker:
        loss_fn(hidden, weight, labels).backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_it_never_holds_the_logits_of_all_positions():
    """2,048 positions, vocabulary 4,096: the full logits' loss holds them in fp32 (and their
    gradient, and the log-probabilities); 256-position chunks hold an eighth of them."""
    hidden, weight, labels = case(positions=2048, vocab=4096, width=64)
    full = peak_bytes(reference, hidden, weight, labels)
    chunked = peak_bytes(lambda h, w, y: head_loss(h, w, y, 256), hidden, weight, labels)
    logits = 2048 * 4096 * 4
    assert full > 2.5 * logits, full / logits
    assert chunked < 0.5 * logits, chunked / logits


def test_a_chunk_of_no_positions_is_refused():
    with pytest.raises(ValueError, match="loss_chunk=0: must be at least 1"):
        validate(TrainConfig(loss_chunk=0))
