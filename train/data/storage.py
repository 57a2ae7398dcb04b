"""Object storage: ``s3://bucket/key`` locations, the sources read from it as streams and the
objects checkpoints write to it (``train/checkpoint/places.py``), through one client.

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

The checkpoints' objects go through the plain helpers at the end (``put_bytes``,
``get_bytes``, ``listing``, ``delete_prefix``: one request or a paginated listing each), and a
failed request becomes one line (``describe_error``) that never holds the secret key.

Torch-free, and boto3 is imported only when a location is a URL.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# What boto3 reads from the environment to make a client: a client made for other values is
# not reused.
CLIENT_ENVIRONMENT = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)
_clients: dict[tuple, Any] = {}


def client_environment() -> tuple:
    """The environment a client is made from, as a key (held in this process's memory only)."""
    return tuple(os.environ.get(name) for name in CLIENT_ENVIRONMENT)


def new_s3_client():
    """A new boto3 S3 client, configured from the environment as it is now."""
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=3 * CONNECT_TIMEOUT_S,
        retries={"max_attempts": 2, "mode": "standard"},
    )
    # A session of its own: the default one keeps the environment it first read.
    return boto3.session.Session().client(S3, config=config)


def s3_client():
    """The process's S3 client for the environment as it is now (made once: a client loads
    botocore's service model, ~50 ms), shared by the data reads here and the checkpoints'
    objects; boto3's clients are thread-safe."""
    key = client_environment()
    if key not in _clients:
        _clients[key] = new_s3_client()
    return _clients[key]


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
    client = s3_client()
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
    client = s3_client()
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


# Objects of checkpoints (train/checkpoint/): written, read, listed and deleted.

SCHEME = "s3://"
DELETE_BATCH = 1000  # the most keys one delete_objects request takes
CREDENTIAL_CODES = ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")
MISSING_CODES = ("404", "NoSuchKey", "NotFound")


def split(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``: the key without leading or trailing slash."""
    if not url.startswith(SCHEME):
        raise ValueError(f"{url}: not an s3:// URL")
    bucket, key = bucket_and_key(url)
    return bucket, key.strip("/")


def join(url: str, *names: str) -> str:
    """``url`` with ``names`` appended, one slash between each."""
    return "/".join([url.rstrip("/"), *(name.strip("/") for name in names)])


def code_of(error: Exception) -> str:
    """The S3 error code of a botocore ClientError ('' for any other error)."""
    response = getattr(error, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def put_bytes(url: str, data: bytes) -> None:
    """Write ``data`` as the object at ``url`` (one PUT)."""
    bucket, key = split(url)
    s3_client().put_object(Bucket=bucket, Key=key, Body=data)


def get_bytes(url: str) -> bytes:
    """The object at ``url`` (one GET); FileNotFoundError if there is none."""
    bucket, key = split(url)
    try:
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as error:
        if code_of(error) in MISSING_CODES:
            raise FileNotFoundError(f"{url}: no such object") from None
        raise


def _objects(client: Any, bucket: str, prefix: str) -> Iterator[dict[str, Any]]:
    """The listed object (Key, Size, LastModified) of every key in ``bucket`` that starts with
    ``prefix``."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in pages:
        yield from page.get("Contents", [])


def listing(prefix_url: str) -> dict[str, tuple[int, float]]:
    """Every object under the prefix, at any depth, by key relative to it (``step_4/COMPLETE``):
    (size in bytes, last modified as a POSIX timestamp)."""
    bucket, key = split(prefix_url)
    prefix = f"{key}/" if key else ""
    return {
        item["Key"][len(prefix) :]: (item["Size"], item["LastModified"].timestamp())
        for item in _objects(s3_client(), bucket, prefix)
    }


def delete_prefix(prefix_url: str) -> int:
    """Delete every object under the prefix, and the object at it if there is one (listed
    first, then deleted 1000 a request); how many. ``.../step_4`` spares ``.../step_40``; a
    bucket's root is refused: that would be the whole bucket."""
    bucket, key = split(prefix_url)
    if not key:
        raise ValueError(f"{prefix_url}: no prefix under the bucket; refusing to empty it")
    client = s3_client()
    listed = (item["Key"] for item in _objects(client, bucket, key))
    keys = [name for name in listed if name == key or name.startswith(f"{key}/")]
    for start in range(0, len(keys), DELETE_BATCH):
        batch = [{"Key": name} for name in keys[start : start + DELETE_BATCH]]
        reply = client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        if reply.get("Errors"):
            first = reply["Errors"][0]
            raise OSError(
                f"{prefix_url}: {len(reply['Errors'])} object(s) not deleted, "
                f"the first {first.get('Key')!r}: {first.get('Code')} {first.get('Message')}"
            )
    return len(keys)


def describe_error(error: Exception, url: str) -> str:
    """One line for a failed request about ``url``: the URL, the endpoint and what to fix. The
    secret key is never in it, even where the server's message would carry it."""
    from botocore.exceptions import (
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    bucket, key = split(url)
    where = f"{url} (endpoint {s3_client().meta.endpoint_url})"
    code = code_of(error)
    if isinstance(error, NoCredentialsError):
        line = (
            f"{where}: no credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE) in the environment"
        )
    elif isinstance(error, EndpointConnectionError | ReadTimeoutError | ConnectTimeoutError):
        line = (
            f"{where}: the endpoint cannot be reached ({error}); check AWS_ENDPOINT_URL and "
            "the network"
        )
    elif code in CREDENTIAL_CODES:
        line = (
            f"{where}: access refused ({code}); check AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, and that they may read and write this bucket"
        )
    elif code == "NoSuchBucket":
        line = f"{where}: bucket {bucket!r} does not exist; create it or fix the URL"
    elif code in MISSING_CODES or isinstance(error, FileNotFoundError):
        line = f"{where}: no object {key!r} in bucket {bucket!r} (or no such bucket); check the URL"
    else:
        line = f"{where}: the request failed ({type(error).__name__}: {error})"
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    if secret:
        line = line.replace(secret, "<secret>")
    return " ".join(line.split())


def check_bucket(url: str) -> None:
    """Raise StorageError unless the bucket of ``url`` answers to the environment's credentials
    (one HEAD: a metadata request, nothing read or written)."""
    bucket, _ = split(url)
    client = s3_client()
    try:
        client.head_bucket(Bucket=bucket)
    except Exception as error:
        if code_of(error) in ("404", "NoSuchBucket"):  # a HEAD's 404 can only mean the bucket
            where = f"{url} (endpoint {client.meta.endpoint_url})"
            raise StorageError(f"{where}: bucket {bucket!r} does not exist") from None
        raise StorageError(describe_error(error, url)) from None
