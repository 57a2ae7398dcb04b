"""Context parallelism's sequence arithmetic: chunks, their order and the causal mask."""

from __future__ import annotations

import pytest
import torch

from train.models.context import causal_mask, local_positions


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ranks_hold_every_position_once(cp):
    seq_len = 8 * cp
    held = torch.cat([local_positions(seq_len, cp, rank) for rank in range(cp)])
    assert sorted(held.tolist()) == list(range(seq_len))


def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_attention_work_is_balanced(cp):
    """Keys each rank's queries attend to, summed: the same on every rank."""
    seq_len = 16 * cp
    work = [int(causal_mask(local_positions(seq_len, cp, r), seq_len).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work


def test_causal_mask_follows_global_positions():
    mask = causal_mask(torch.tensor([1, 6]), 8)
    assert mask.tolist() == [
        [True, True, False, False, False, False, False, False],
        [True, True, True, True, True, True, True, False],
    ]
