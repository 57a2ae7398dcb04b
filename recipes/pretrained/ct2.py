"""A reader of CTranslate2's ``model.bin`` (binary format 6, as ``ctranslate2.specs`` writes it):
its spec's name and revision, and every variable as a numpy array, aliases resolved.

Layout, little-endian: u32 version, string spec name, u32 revision, u32 count, then per variable
a string name, u8 rank, u32 per dimension, u8 dtype id, u32 byte count and the bytes; then u32
alias count and (alias, target) string pairs. A string is a u16 length (its NUL included), the
UTF-8 bytes and a NUL.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

BINARY_VERSION = 6
# CTranslate2's type ids, in its order.
DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, None)  # 5 is bfloat16


@dataclass(frozen=True)
class CT2Model:
    spec: str
    revision: int
    variables: dict[str, np.ndarray]


def _read(f: BinaryIO, fmt: str):
    return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "H"))[:-1].decode("utf-8")


def read_model(path: Path) -> CT2Model:
    """Every variable of the CTranslate2 model file ``path``; anything but format 6 or a
    bfloat16 variable is refused with one line."""
    with path.open("rb") as f:
        version = _read(f, "I")
        if version != BINARY_VERSION:
            raise ValueError(
                f"{path}: CTranslate2 binary format {version}, expected {BINARY_VERSION}"
            )
        spec, revision = _string(f), _read(f, "I")
        variables: dict[str, np.ndarray] = {}
        for _ in range(_read(f, "I")):
            name = _string(f)
            shape = tuple(_read(f, "I") for _ in range(_read(f, "B")))
            type_id, size = _read(f, "B"), _read(f, "I")
            dtype = DTYPES[type_id] if type_id < len(DTYPES) else None
            if dtype is None:
                raise ValueError(f"{path}: variable {name} has type id {type_id}, not supported")
            variables[name] = np.frombuffer(f.read(size), dtype=dtype).reshape(shape)
        for _ in range(_read(f, "I")):
            alias, target = _string(f), _string(f)
            variables[alias] = variables[target]
    return CT2Model(spec, revision, variables)
