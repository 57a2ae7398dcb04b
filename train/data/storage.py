"""Sources in object storage: ``s3://bucket/key`` locations, read as streams.

lhotse opens a URL through smart_open (``lhotse.serialization.open_best``), which reads S3 with
boto3: cut manifests, Shar shards and audio (a cut's ``url`` audio source) stream from the bucket
as the data pipeline reads them; nothing is copied to disk. Credentials and the endpoint come
from the environment only, as boto3 reads them (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``; ``AWS_ENDPOINT_URL`` for an
S3-compatible store: MinIO, AIStore's S3 API, Ceph, rclone): nothing here writes them anywhere.

Before any process group, ``check_location`` asks the store about each location with metadata
requests only (the bucket, then the object, or the listing under a Shar prefix): a missing
bucket or object, refused credentials or an unreachable endpoint is one line naming the
location and what to set. No object's content is read.

Torch-free, and boto3 is imported only when a location is a URL.
"""

from __future__ import annotations

import re
from pathlib import Path

S3 = "s3"
# Schemes users bring from NeMo configs that this toolkit does not read, and what to do instead.
UNSUPPORTED = {
    "ais": "AIStore's Python SDK is not a dependency; point s3:// at AIStore's S3 API instead "
    "(AWS_ENDPOINT_URL=http://<ais-proxy>/s3)",
    "msc": "the Multi-Storage Client is not a dependency; use the s3:// location it maps to",
}
# A Shar shard's object name: <field>.<index>.<extension> (lhotse's SharWriter).
SHAR_SHARD = re.compile(r"^(?P<field>[A-Za-z_]+)\.(?P<index>\d{6})\.(?P<ext>jsonl\.gz|tar)$")
CONNECT_TIMEOUT_S = 5.0  # a check waits this long for an endpoint that does not answer


class StorageError(ValueError):
    """A location that cannot be read; the message names it and the setting to fix."""


def is_url(location: str | Path) -> bool:
    """Whether ``location`` names an object store (``scheme://...``); a Path never does."""
    return isinstance(location, str) and "://" in location


def scheme(url: str) -> str:
    return url.split("://", 1)[0].lower()


def refusal(url: str) -> str | None:
    """Why ``url`` cannot be read here (None: an s3:// URL)."""
    name = scheme(url)
    if name == S3:
        return None
    return UNSUPPORTED.get(name, "only s3:// object storage is read (smart_open with boto3)")


def bucket_and_key(url: str) -> tuple[str, str]:
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def _client():
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=3 * CONNECT_TIMEOUT_S,
        retries={"max_attempts": 2, "mode": "standard"},
    )
    # A session of its own: the default one keeps the environment it first read.
    return boto3.session.Session().client(S3, config=config)


def _explain(error: Exception, url: str, endpoint: str, what: str) -> StorageError:
    """One line for a failed metadata request about ``url``."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    where = f"{url} (endpoint {endpoint})"
    if isinstance(error, NoCredentialsError):
        return StorageError(
            f"{where}: no credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE) in the environment"
        )
    if isinstance(error, (EndpointConnectionError, ReadTimeoutError)):
        return StorageError(
            f"{where}: the endpoint cannot be reached ({error}); check AWS_ENDPOINT_URL and "
            "the network"
        )
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StorageError(
                f"{where}: access refused ({code}); check AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, and that they may read this bucket"
            )
        if code in ("404", "NoSuchBucket", "NoSuchKey"):
            return StorageError(f"{where}: {what} does not exist")
    return StorageError(f"{where}: {what} cannot be read ({error})")


def check_location(url: str, prefix: bool = False) -> None:
    """Raise StorageError unless the bucket and the object at ``url`` exist and may be read
    (``prefix``: at least one object under it); metadata requests only."""
    why = refusal(url)
    if why is not None:
        raise StorageError(f"{url}: {why}")
    client = _client()
    endpoint = client.meta.endpoint_url
    bucket, key = bucket_and_key(url)
    try:
        client.head_bucket(Bucket=bucket)
    except Exception as error:
        raise _explain(error, url, endpoint, f"bucket {bucket!r}") from None
    try:
        if prefix:
            listed = client.list_objects_v2(Bucket=bucket, Prefix=_as_prefix(key), MaxKeys=1)
            if not listed.get("KeyCount"):
                raise StorageError(f"{url} (endpoint {endpoint}): no object under this prefix")
        else:
            client.head_object(Bucket=bucket, Key=key)
    except StorageError:
        raise
    except Exception as error:
        raise _explain(error, url, endpoint, f"object {key!r}") from None


def _as_prefix(key: str) -> str:
    return key if not key or key.endswith("/") else key + "/"


def shar_shards(location: Path | str) -> dict[str, list[Path | str]]:
    """The shards of the Shar at ``location`` (a local directory or an s3:// prefix), by field,
    each field's shards in index order: what lhotse's ``CutSet.from_shar(fields=...)`` takes.
    Listing only; a StorageError names a location that holds no Shar."""
    if isinstance(location, Path):
        names = [(p.name, p) for p in location.iterdir() if p.is_file()]
    else:
        names = _listing(location)
    shards: dict[str, list[tuple[str, Path | str]]] = {}
    for name, where in names:
        match = SHAR_SHARD.match(name)
        if match:
            shards.setdefault(match["field"], []).append((match["index"], where))
    if "cuts" not in shards:
        raise StorageError(f"{location}: no cuts.<index>.jsonl.gz shards in it: not a Shar")
    counts = {field: len(items) for field, items in shards.items()}
    if len(set(counts.values())) != 1:
        raise StorageError(f"{location}: the Shar's fields have different shard counts {counts}")
    return {field: [where for _, where in sorted(items)] for field, items in shards.items()}


def _listing(url: str) -> list[tuple[str, str]]:
    """(name, URL) of each object directly under prefix ``url``."""
    client = _client()
    bucket, key = bucket_and_key(url)
    prefix = _as_prefix(key)
    found = []
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix, Delimiter="/"
    )
    for page in pages:
        for item in page.get("Contents", []):
            found.append((item["Key"][len(prefix) :], f"{S3}://{bucket}/{item['Key']}"))
    return found
