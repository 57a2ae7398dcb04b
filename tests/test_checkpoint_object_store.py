"""Checkpoints in object storage (train/checkpoint/object_store.py), against a real S3 server
(``rclone serve s3`` on loopback) with the credentials in the environment only: DCP saves and
loads through S3StorageWriter/Reader, without a process group and in a gloo group; a file over
``part_bytes`` goes up as a multipart upload, and one whose writer raises leaves no object; the
reader's read-ahead makes a load of 200 tensors a handful of GETs; the plain helpers; and a
failed request is one line naming the URL and the fix, never the secret key."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.harness.object_store import SECRET_KEY, ObjectStore, free_port, object_store
from train.checkpoint.object_store import (
    MIN_PART_BYTES,
    S3FileSystem,
    S3StorageReader,
    S3StorageWriter,
)
from train.data import storage

BUCKET = "checkpoints"
ROOT = f"s3://{BUCKET}"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObjectStore]:
    """The server, and its credentials and endpoint in the environment, for the whole module."""
    root = tmp_path_factory.mktemp("s3") / "root"
    with object_store(root, (BUCKET,)) as server, pytest.MonkeyPatch.context() as patch:
        for name, value in server.env().items():
            patch.setenv(name, value)
        yield server


def mixed_state() -> dict:
    """Tensors of several dtypes and shapes (a 0-dim one, one of 3 MB) and plain values."""
    generator = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(768, 1024, generator=generator),  # 3 MB of float32
        "bias": torch.randn(7, dtype=torch.float64, generator=generator),
        "scale": torch.tensor(0.125, dtype=torch.bfloat16),
        "step": torch.tensor(12345),
        "ids": torch.randint(-1000, 1000, (3, 11), dtype=torch.int32, generator=generator),
        "mask": torch.rand(2, 3, 5, generator=generator) > 0.5,
        "epoch": 7,
        "schedule": [1, 2.5, "three"],
        "name": "run-a",
    }


def zeroed(state: dict) -> dict:
    """A copy of ``state`` with every value emptied: what a load must fill in."""
    empty = {int: 0, list: [], str: ""}
    return {
        key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else empty[type(value)]
        for key, value in state.items()
    }


def assert_same(loaded: dict, saved: dict) -> None:
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


@pytest.mark.parametrize("group", [False, True], ids=["no_process_group", "gloo"])
def test_a_dcp_round_trip_through_the_bucket(
    store: ObjectStore, request: pytest.FixtureRequest, group: bool
) -> None:
    if group:
        request.getfixturevalue("one_rank_group")
    url = f"{ROOT}/roundtrip_{request.node.callspec.id}/step_4"
    saved = mixed_state()
    dcp.save(saved, storage_writer=S3StorageWriter(url, per_thread_copy_ahead=0))
    assert set(storage.listing(url)) == {".metadata", "__0_0.distcp"}  # the temporary one renamed

    loaded = zeroed(saved)
    dcp.load(loaded, storage_reader=S3StorageReader(url))
    assert_same(loaded, saved)
    metadata = S3StorageReader(url).read_metadata()
    assert set(metadata.state_dict_metadata) == set(saved)


def test_a_file_over_part_bytes_is_a_multipart_upload(store: ObjectStore) -> None:
    url = f"{ROOT}/multipart"
    saved = {"big": torch.arange(3_000_000, dtype=torch.float32), "step": 9}  # 12 MB
    dcp.save(saved, storage_writer=S3StorageWriter(url, part_bytes=MIN_PART_BYTES))

    size, _ = storage.listing(url)["__0_0.distcp"]
    assert size > 2 * MIN_PART_BYTES  # three parts at least
    assert size == (store.root / BUCKET / "multipart/__0_0.distcp").stat().st_size
    log = store.log.read_text()
    parts = [line for line in log.splitlines() if "put multipart upload" in line]
    assert len(parts) >= 3 and all("multipart/__0_0.distcp" in line for line in parts), parts
    loaded = {"big": torch.zeros(3_000_000), "step": 0}
    dcp.load(loaded, storage_reader=S3StorageReader(url))
    assert_same(loaded, saved)


def test_a_write_that_raises_leaves_no_object(store: ObjectStore) -> None:
    url = f"{ROOT}/aborted/__0_0.distcp"
    fs = S3FileSystem(part_bytes=MIN_PART_BYTES)
    with pytest.raises(RuntimeError, match="the writer failed"), fs.create_stream(url, "wb") as out:
        out.write(b"x" * (2 * MIN_PART_BYTES + 1))  # two parts sent
        raise RuntimeError("the writer failed")
    assert not fs.exists(url)
    assert storage.listing(f"{ROOT}/aborted") == {}
    assert "abort multipart upload checkpoints aborted/__0_0.distcp" in store.log.read_text()
    with pytest.raises(ValueError, match="5242880 or more"):
        S3FileSystem(part_bytes=MIN_PART_BYTES - 1)


def test_a_load_of_many_small_tensors_reads_ahead(store: ObjectStore) -> None:
    url = f"{ROOT}/small"
    saved = {f"t{i}": torch.full((4,), float(i)) for i in range(200)}
    dcp.save(saved, storage_writer=S3StorageWriter(url))
    before = len(store.gets())
    loaded = {key: torch.zeros(4) for key in saved}
    dcp.load(loaded, storage_reader=S3StorageReader(url))
    gets = store.gets()[before:]
    assert_same(loaded, saved)
    # .metadata once, and the data file's ~200 kB in one block: not a GET per tensor.
    assert len(gets) <= 4, gets
    print(f"GET requests for a load of 200 tensors: {len(gets)}")


def test_the_reader_seeks_and_reads_across_blocks(store: ObjectStore) -> None:
    url = f"{ROOT}/blocks/data"
    data = random.Random(0).randbytes(10_000)
    storage.put_bytes(url, data)
    fs = S3FileSystem(read_ahead=1_000)
    generator = random.Random(1)
    with fs.create_stream(url, "rb") as stream:
        assert stream.seekable() and stream.readable()
        assert stream.seek(0, 2) == len(data) and stream.read(5) == b""
        for _ in range(100):
            start, count = generator.randrange(len(data)), generator.randrange(2_500)
            stream.seek(start)
            assert stream.read(count) == data[start : start + count]
            assert stream.tell() == min(start + count, len(data))
        stream.seek(-100, 2)
        into = bytearray(300)
        assert stream.readinto(into) == 100 and bytes(into[:100]) == data[-100:]
        stream.seek(123)
        assert stream.read() == data[123:]


def test_plain_objects_listing_and_deleting(store: ObjectStore) -> None:
    run = f"{ROOT}/run"
    assert storage.split(f"{run}/step_4/") == (BUCKET, "run/step_4")
    assert storage.join(f"{run}/", "/step_4", "COMPLETE") == f"{run}/step_4/COMPLETE"
    storage.put_bytes(storage.join(run, "step_4", "COMPLETE"), b"done")
    storage.put_bytes(storage.join(run, "step_4", "model", "__0_0.distcp"), b"x" * 1000)
    storage.put_bytes(storage.join(run, "step_40", "COMPLETE"), b"")
    storage.put_bytes(f"{ROOT}/run_other/COMPLETE", b"keep")

    listed = storage.listing(run)
    assert set(listed) == {"step_4/COMPLETE", "step_4/model/__0_0.distcp", "step_40/COMPLETE"}
    assert [listed[name][0] for name in sorted(listed)] == [4, 1000, 0]
    modified = (store.root / BUCKET / "run/step_4/COMPLETE").stat().st_mtime
    assert abs(listed["step_4/COMPLETE"][1] - modified) < 2
    assert storage.get_bytes(storage.join(run, "step_4", "COMPLETE")) == b"done"
    with pytest.raises(FileNotFoundError):
        storage.get_bytes(storage.join(run, "step_5", "COMPLETE"))
    with pytest.raises(FileNotFoundError):
        S3StorageReader(storage.join(run, "step_5")).read_metadata()

    assert (
        storage.delete_prefix(storage.join(run, "step_4", "COMPLETE")) == 1
    )  # one object, by its URL
    assert set(storage.listing(run)) == {"step_4/model/__0_0.distcp", "step_40/COMPLETE"}
    storage.put_bytes(storage.join(run, "step_4", "COMPLETE"), b"done")
    assert storage.delete_prefix(storage.join(run, "step_4")) == 2
    assert set(storage.listing(run)) == {"step_40/COMPLETE"}  # step_4's siblings stay
    assert storage.delete_prefix(run) == 1 and storage.listing(run) == {}
    assert storage.get_bytes(f"{ROOT}/run_other/COMPLETE") == b"keep"
    with pytest.raises(ValueError, match="refusing"):
        storage.delete_prefix(ROOT)


def failure(action, url: str) -> str:
    """describe_error's line for the error ``action(url)`` raises."""
    with pytest.raises(Exception) as raised:
        action(url)
    line = storage.describe_error(raised.value, url)
    assert url in line and "\n" not in line and SECRET_KEY not in line, line
    return line


def test_a_wrong_secret_is_one_line_without_it(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = "wrong-secret-0d9a7c"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    line = failure(lambda url: storage.put_bytes(url, b"x"), f"{ROOT}/denied/COMPLETE")
    assert "access refused" in line and "AWS_SECRET_ACCESS_KEY" in line, line
    assert store.endpoint in line and wrong not in line, line


def test_a_missing_bucket_is_one_line(store: ObjectStore) -> None:
    line = failure(lambda url: storage.put_bytes(url, b"x"), "s3://nobucket/run/COMPLETE")
    assert "bucket 'nobucket' does not exist" in line, line


def test_an_unreachable_endpoint_is_one_line(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    line = failure(storage.get_bytes, f"{ROOT}/run/COMPLETE")
    assert "the endpoint cannot be reached" in line and f"endpoint {closed}" in line, line
