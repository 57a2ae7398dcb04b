"""The data seed contract on real lhotse data: TP peers equal, DP ranks disjoint, jobs differ."""

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
from lhotse import CutSet
from lhotse.dataset.dataloading import LHOTSE_PROCESS_SEED

from contract.job_env import SEED_LIMIT
from train.data.batch_hash import append_batch_hash, batch_hash
from train.data.loader import batches_forever, build_dataloader, make_worker_init_fn
from train.data.text import ByteTokenizer
from train.seeding import rank_data_seed, sampler_seed

PAD_ID = 256


BYTES = ByteTokenizer()


@pytest.fixture(scope="module")
def corpus(tiny_corpus: Path) -> Path:
    """The session's 16-utterance corpus (tests/conftest.py)."""
    return tiny_corpus


def read(source: Path, **overrides) -> list[dict]:
    """All batches of one epoch for one rank."""
    args = {
        "max_duration": 5.0,
        "job_seed": 7,
        "dp_rank": 0,
        "dp_size": 1,
        "num_workers": 0,
        "text": BYTES,
        "buckets": 2,
        **overrides,
    }
    return list(build_dataloader(source, **args))


def ids(batches: list[dict]) -> list[list[str]]:
    return [b["cut_ids"] for b in batches]


def hashes(batches: list[dict]) -> list[str]:
    return [batch_hash(b) for b in batches]


@pytest.fixture(scope="module")
def train_cuts(corpus) -> Path:
    return corpus / "cuts_train.jsonl.gz"


def test_rank_data_seed_is_distinct_and_below_2_31():
    grid = list(itertools.product([0, 1, 2, 100000, 2**31 - 1], range(8), range(4), range(2)))
    seeds = [rank_data_seed(s, r, w, epoch=e) for s, r, w, e in grid]
    assert len(set(seeds)) == len(grid)
    assert all(0 <= s < SEED_LIMIT for s in seeds)
    assert seeds == [rank_data_seed(s, r, w, epoch=e) for s, r, w, e in grid]
    assert rank_data_seed(100000, 0) != rank_data_seed(0, 1)
    samplers = {sampler_seed(s, e) for s in range(50) for e in range(4)}
    assert len(samplers) == 200 and not samplers & set(seeds)


def test_negative_inputs_are_rejected():
    with pytest.raises(ValueError, match="non-negative"):
        rank_data_seed(-1, 0)
    with pytest.raises(ValueError, match="non-negative"):
        rank_data_seed(1, -2)


def test_tp_peers_read_byte_identical_batches(train_cuts):
    for dp_rank in (0, 1):
        peer_a = read(train_cuts, dp_rank=dp_rank, dp_size=2)
        peer_b = read(train_cuts, dp_rank=dp_rank, dp_size=2)
        assert peer_a
        assert hashes(peer_a) == hashes(peer_b)


def test_dp_ranks_read_disjoint_cuts_and_equal_batch_counts(train_cuts):
    rank0 = read(train_cuts, dp_rank=0, dp_size=2)
    rank1 = read(train_cuts, dp_rank=1, dp_size=2)
    seen0 = {c for b in ids(rank0) for c in b}
    seen1 = {c for b in ids(rank1) for c in b}
    assert seen0 and seen1
    assert not seen0 & seen1
    assert len(rank0) == len(rank1)
    assert seen0 | seen1 <= set(CutSet.from_file(train_cuts).ids)


def test_new_job_seed_gives_new_order_and_same_seed_repeats(train_cuts):
    first = read(train_cuts, job_seed=7)
    again = read(train_cuts, job_seed=7)
    other = read(train_cuts, job_seed=8)
    assert hashes(first) == hashes(again)
    assert ids(first) != ids(other)


def test_workers_do_not_change_the_batches(train_cuts):
    inline = read(train_cuts, dp_rank=1, dp_size=2, num_workers=0)
    workers = read(train_cuts, dp_rank=1, dp_size=2, num_workers=2)
    assert hashes(inline) == hashes(workers)


def test_batches_are_padded_tensors_of_the_cut_text(train_cuts):
    texts = {c.id: c.supervisions[0].text for c in CutSet.from_file(train_cuts)}
    for batch in read(train_cuts):
        features, tokens = batch["features"], batch["tokens"]
        size = len(batch["cut_ids"])
        assert features.dtype == torch.float32 and features.shape[0] == size
        assert features.shape[1:2] == (1,) and features.shape[3] == 80  # one segment each
        assert int(batch["feature_lens"].max()) == features.shape[2]
        assert tokens.dtype == torch.int64 and tokens.shape[0] == size
        for row, cut_id in enumerate(batch["cut_ids"]):
            length = int(batch["token_lens"][row])
            assert tokens[row, :length].tolist() == BYTES.encode(texts[cut_id])
            assert (tokens[row, length:] == PAD_ID).all()
            assert (features[row, 0, int(batch["feature_lens"][row, 0]) :] == 0).all()


def test_epochs_reshuffle_within_a_job(train_cuts):
    def loader(epoch: int):
        return build_dataloader(
            train_cuts,
            max_duration=5.0,
            job_seed=7,
            dp_rank=0,
            dp_size=1,
            num_workers=0,
            text=BYTES,
            buckets=2,
            epoch=epoch,
        )

    stream = list(itertools.takewhile(lambda item: item[0] < 3, batches_forever(loader)))
    orders = [[b["cut_ids"] for e, b in stream if e == epoch] for epoch in range(3)]
    assert [e for e, _ in stream] == sorted(e for e, _ in stream)
    assert all(orders)
    assert orders == [ids(list(loader(epoch))) for epoch in range(3)]
    assert orders[0] != orders[1] != orders[2]


def test_empty_epoch_is_an_error_not_a_hang():
    with pytest.raises(ValueError, match="produced no batches"):
        next(batches_forever(lambda epoch: []))


class WorkerProbe(torch.utils.data.Dataset):
    """Reports, from inside a real worker process, the seeds that worker was given."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        info = torch.utils.data.get_worker_info()
        return info.id, int(os.environ[LHOTSE_PROCESS_SEED]), torch.initial_seed()


def test_worker_seeds_are_distinct_and_derived_from_the_contract():
    def probe(dp_rank: int) -> set[tuple[int, int, int]]:
        loader = torch.utils.data.DataLoader(
            WorkerProbe(),
            batch_size=None,
            num_workers=2,
            worker_init_fn=make_worker_init_fn(job_seed=7, dp_rank=dp_rank),
        )
        return {tuple(item) for item in loader}

    rank0, rank1 = probe(0), probe(1)
    assert rank0 == {(w, rank_data_seed(7, 0, w), rank_data_seed(7, 0, w)) for w in (0, 1)}
    assert rank1 == {(w, rank_data_seed(7, 1, w), rank_data_seed(7, 1, w)) for w in (0, 1)}
    assert len({seed for _, seed, _ in rank0 | rank1}) == 4


def test_shar_stream_follows_the_contract(corpus):
    shar = corpus / "shar" / "train"
    peer_a = read(shar, shar=True, dp_rank=0, dp_size=2, num_workers=2)
    peer_b = read(shar, shar=True, dp_rank=0, dp_size=2, num_workers=2)
    other_rank = read(shar, shar=True, dp_rank=1, dp_size=2, num_workers=2)
    other_job = read(shar, shar=True, job_seed=8, dp_rank=0, dp_size=2, num_workers=2)
    assert peer_a
    assert hashes(peer_a) == hashes(peer_b)
    assert ids(peer_a) != ids(other_rank)
    assert ids(peer_a) != ids(other_job)
    # Without workers a rank reads what its worker 0 reads; the loader interleaves workers.
    inline = iter(ids(read(shar, shar=True, dp_rank=0, dp_size=2, num_workers=0)))
    expected = next(inline)
    for batch_ids in ids(peer_a):
        if expected is not None and batch_ids == expected:
            expected = next(inline, None)
    assert expected is None


def test_batch_hash_covers_name_dtype_shape_and_bytes():
    base = {"x": torch.arange(6, dtype=torch.int64).reshape(2, 3), "ids": ["a", "b"]}
    digest = batch_hash(base)
    assert digest == batch_hash({"x": base["x"].clone(), "ids": ["c"]})
    assert digest != batch_hash({"x": base["x"].reshape(3, 2)})
    assert digest != batch_hash({"x": base["x"].to(torch.int32)})
    assert digest != batch_hash({"y": base["x"]})
    changed = base["x"].clone()
    changed[1, 2] = 99
    assert digest != batch_hash({"x": changed})
    assert batch_hash({"x": base["x"].t()}) == batch_hash({"x": base["x"].t().contiguous()})


def test_batch_hash_lines_are_appended_per_rank(tmp_path):
    coords = {"dp_shard": 1, "tp": 0}
    append_batch_hash(tmp_path, step=1, rank=3, coords=coords, digest="aa")
    path = append_batch_hash(tmp_path, step=2, rank=3, coords=coords, digest="bb")
    assert path == tmp_path / "batch_hashes" / "rank3.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"step": 1, "rank": 3, "coords": coords, "hash": "aa"},
        {"step": 2, "rank": 3, "coords": coords, "hash": "bb"},
    ]
