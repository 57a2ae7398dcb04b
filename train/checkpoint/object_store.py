"""Checkpoints in object storage: DCP saves to and loads from ``s3://bucket/prefix`` through boto3.

torch's own route to a bucket is fsspec with s3fs (``FsspecWriter``), and s3fs (through
aiobotocore) pins an older botocore than the boto3 the data reads use (train/data/storage.py).
So DCP gets a filesystem of our own here, ``S3FileSystem``, with the same client as the data
reads (``s3_client``) and the credentials and endpoint from the environment only: nothing here
writes or logs them.

What a save costs, per rank: one HEAD (is there a checkpoint already) and per data file one
PUT, or for a file over ``part_bytes`` a multipart upload (one request to start it, one per part
as each fills, one to complete it: memory holds one part, not the file). The coordinator then
writes ``.metadata`` as DCP does, a temporary object renamed: PUT, HEAD, COPY, DELETE (and a
DELETE of an older ``.metadata``). A load: ``.metadata`` (a HEAD and a GET), then per data file
a HEAD and one ranged GET per ``read_ahead`` bytes read in order: DCP reads each tensor with
many small reads, and the block read ahead serves them.

The plain object helpers (one request or a paginated listing each, torch-free) are
train/data/storage.py's, as is the line a failed request gets.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import (
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
)

from train.data.storage import (
    MISSING_CODES,
    SCHEME,
    client_environment,
    code_of,
    join,
    new_s3_client,
    split,
)

PART_BYTES = 64 * 2**20  # a file larger than this is uploaded in parts of this size
MIN_PART_BYTES = 5 * 2**20  # S3's smallest part, the last one excepted
READ_AHEAD = 8 * 2**20  # bytes one ranged GET fetches for the reads that follow


class _Upload(io.RawIOBase):
    """A write-only stream into one object: a single PUT on close if it holds at most
    ``part_bytes``, else a multipart upload that sends each part as it fills."""

    def __init__(self, client: Any, url: str, part_bytes: int) -> None:
        super().__init__()
        self._client = client
        self._bucket, self._key = split(url)
        self._part_bytes = part_bytes
        self._buffer = bytearray()
        self._written = 0
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError("write to a closed upload")
        view = memoryview(data).cast("B")
        count = len(view)
        self._written += count
        while view:
            if len(self._buffer) == self._part_bytes:  # more is coming: this part is not last
                self._send_part()
            room = self._part_bytes - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
        return count

    def _send_part(self) -> None:
        if self._upload_id is None:
            started = self._client.create_multipart_upload(Bucket=self._bucket, Key=self._key)
            self._upload_id = started["UploadId"]
        number = len(self._parts) + 1
        sent = self._client.upload_part(
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=bytes(self._buffer),
        )
        self._parts.append({"PartNumber": number, "ETag": sent["ETag"]})
        self._buffer = bytearray()

    def close(self) -> None:
        """Upload what is buffered and complete the object (aborting the upload on failure)."""
        if self.closed:
            return
        try:
            if self._upload_id is None:
                self._client.put_object(
                    Bucket=self._bucket, Key=self._key, Body=bytes(self._buffer)
                )
            else:
                self._send_part()
                self._client.complete_multipart_upload(
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},
                )
        except BaseException:
            self.abort()
            raise
        finally:
            super().close()

    def abort(self) -> None:
        """Drop what was written: the parts sent so far are discarded, no object is made."""
        if self.closed:
            return
        self._buffer = bytearray()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self._client.abort_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=upload_id
            )
        super().close()


class _RangeReader(io.RawIOBase):
    """A seekable read-only stream over one object: ranged GETs of ``read_ahead`` bytes, the
    current block kept for the small reads that follow; a read of a block or more is fetched
    whole."""

    def __init__(self, client: Any, url: str, read_ahead: int) -> None:
        super().__init__()
        self._client = client
        self._bucket, self._key = split(url)
        try:
            head = client.head_object(Bucket=self._bucket, Key=self._key)
        except Exception as error:
            if code_of(error) in MISSING_CODES:
                raise FileNotFoundError(f"{url}: no such object") from None
            raise
        self._size: int = head["ContentLength"]
        self._read_ahead = read_ahead
        self._position = 0
        self._block_start = 0
        self._block = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), max(0, self._size - self._position))
        done = 0
        while done < wanted:
            inside = self._position - self._block_start
            if 0 <= inside < len(self._block):
                count = min(wanted - done, len(self._block) - inside)
                view[done : done + count] = memoryview(self._block)[inside : inside + count]
            elif wanted - done >= self._read_ahead:
                count = wanted - done
                view[done:wanted] = self._get(self._position, count)
            else:
                self._block_start = self._position
                self._block = self._get(
                    self._position, min(self._read_ahead, self._size - self._position)
                )
                continue
            done += count
            self._position += count
        return done

    def read(self, size: int | None = -1) -> bytes:
        remaining = max(0, self._size - self._position)
        count = remaining if size is None or size < 0 else min(size, remaining)
        buffer = bytearray(count)
        self.readinto(buffer)
        return bytes(buffer)

    def readall(self) -> bytes:
        return self.read()

    def _get(self, start: int, count: int) -> bytes:
        reply = self._client.get_object(
            Bucket=self._bucket, Key=self._key, Range=f"bytes={start}-{start + count - 1}"
        )
        return reply["Body"].read()


def _no_checksum_mode(params: dict[str, Any], model: Any, **_: Any) -> None:
    """A ranged GET asks for no checksum: a range cannot be checked against the whole object's
    checksum, which some S3-compatible stores (rclone) send with every range and botocore
    would then refuse."""
    if model.name == "GetObject":
        params.pop("ChecksumMode", None)


_ranged_clients: dict[tuple, Any] = {}


def ranged_client():
    """The process's client for DCP's files (``s3_client``'s, made apart): its GETs ask for no
    checksum, which a ranged read cannot check against the whole object's."""
    key = client_environment()
    if key not in _ranged_clients:
        client = new_s3_client()
        # Last: after botocore's handler for every operation, which sets ChecksumMode=ENABLED.
        client.meta.events.register_last("before-parameter-build", _no_checksum_mode)
        _ranged_clients[key] = client
    return _ranged_clients[key]


class S3FileSystem(FileSystemBase):
    """DCP's file operations on ``s3://`` URLs: a file is an object, a directory a prefix."""

    def __init__(self, part_bytes: int = PART_BYTES, read_ahead: int = READ_AHEAD) -> None:
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes={part_bytes}: S3's parts are {MIN_PART_BYTES} or more")
        self.part_bytes = part_bytes
        self.read_ahead = read_ahead
        self.client = ranged_client()  # thread-safe: DCP's writer threads share it

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        """``"wb"``: an upload, made on close and aborted if the block raises; ``"rb"``: a
        seekable reader of ranged GETs."""
        url = os.fspath(path)
        if mode == "rb":
            with _RangeReader(self.client, url, self.read_ahead) as reader:
                yield reader
        elif mode == "wb":
            upload = _Upload(self.client, url, self.part_bytes)
            try:
                yield upload
            except BaseException:
                upload.abort()
                raise
            upload.close()  # DCP's writer closes it itself; then this does nothing
        else:
            raise ValueError(f"{url}: mode {mode!r} is not 'rb' or 'wb'")

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return join(os.fspath(path), suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """A server-side copy (objects up to 5 GB: DCP renames only its metadata) and a delete."""
        bucket, key = split(os.fspath(path))
        new_bucket, new_key = split(os.fspath(new_path))
        self.client.copy_object(
            Bucket=new_bucket, Key=new_key, CopySource={"Bucket": bucket, "Key": key}
        )
        self.client.delete_object(Bucket=bucket, Key=key)

    def init_path(self, path: str | os.PathLike) -> str:
        url = os.fspath(path)
        split(url)  # refuses anything but an s3:// URL
        return url

    def mkdir(self, path: str | os.PathLike) -> None:
        """Nothing: a prefix exists once an object is under it."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, str) and checkpoint_id.startswith(SCHEME)

    def exists(self, path: str | os.PathLike) -> bool:
        bucket, key = split(os.fspath(path))
        try:
            self.client.head_object(Bucket=bucket, Key=key)
        except Exception as error:
            if code_of(error) in MISSING_CODES:
                return False
            raise
        return True

    def rm_file(self, path: str | os.PathLike) -> None:
        bucket, key = split(os.fspath(path))
        self.client.delete_object(Bucket=bucket, Key=key)


class S3StorageWriter(FileSystemWriter):
    """DCP's FileSystemWriter writing to ``s3://`` (no fsync: an object is durable once its
    upload completes)."""

    def __init__(
        self,
        url: str,
        per_thread_copy_ahead: int = 10_000_000,
        thread_count: int = 1,
        part_bytes: int = PART_BYTES,
    ) -> None:
        super().__init__(
            url,
            sync_files=False,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
        )
        self.fs = S3FileSystem(part_bytes=part_bytes)
        self.path = self.fs.init_path(url)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return S3FileSystem.validate_checkpoint_id(checkpoint_id)


class S3StorageReader(FileSystemReader):
    """DCP's FileSystemReader reading from ``s3://``."""

    def __init__(self, url: str, read_ahead: int = READ_AHEAD) -> None:
        super().__init__(url)
        self.fs = S3FileSystem(read_ahead=read_ahead)
        self.path = self.fs.init_path(url)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return S3FileSystem.validate_checkpoint_id(checkpoint_id)
