"""Where a damaged GGUF file breaks: the metadata key, tensor info or tensor data that is cut or
corrupt, for the error message.

gguf.GGUFReader reads a truncated file until a NumPy view comes up short and then fails with a
reshape or dtype error that names nothing. engine/loader/gguf.py calls `check_layout` only after
the reader has failed (a good file pays nothing): it walks the same header (magic, version,
counts, key/value pairs, tensor infos; llama.cpp's gguf.cpp layout) with the file's size in hand
and raises ValueError naming the file and the first part that does not fit. The tensor data is
not read, only its extent checked against the file's end.
"""
from __future__ import annotations

import math
import mmap
import os
import struct

from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

SUPPORTED_VERSIONS = (2, 3)        # gguf-py's reader: version 1 used 32-bit counts
MAX_DIMS = 4                       # GGML_MAX_DIMS

# GGUFValueType -> (struct code, size) for the fixed-size types; 8 STRING and 9 ARRAY are walked
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
            6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_STRING, _ARRAY = 8, 9


def read_version(path: str, head: bytes) -> int:
    """The version in a GGUF file's first 8 bytes (either byte order); ValueError naming the file
    when it is one gguf-py cannot read."""
    if len(head) < 8:
        raise ValueError(f"{path}: truncated GGUF file: {len(head)} bytes, shorter than the "
                         "8-byte magic and version")
    version = struct.unpack_from("<I", head, 4)[0]
    if version & 0xFFFF == 0:             # written on a machine of the other byte order
        version = struct.unpack_from(">I", head, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not supported (versions "
                         f"{', '.join(map(str, SUPPORTED_VERSIONS))} are)")
    return version


class _Cursor:
    """Reads the header front to back; any read past the end names what was being read."""

    def __init__(self, path: str, buf, order: str):
        self.path, self.buf, self.order, self.pos, self.size = path, buf, order, 0, len(buf)

    def cut(self, what: str, n: int) -> ValueError:
        return ValueError(f"{self.path}: truncated or corrupt GGUF file: {what} needs bytes "
                          f"[{self.pos}, {self.pos + n}) but the file has {self.size}")

    def skip(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise self.cut(what, n)
        self.pos += n

    def scalar(self, code: str, what: str):
        n = struct.calcsize(code)
        if self.pos + n > self.size:
            raise self.cut(what, n)
        value = struct.unpack_from(self.order + code, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        start = self.pos
        self.skip(n, what)
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")


def _skip_value(cur: _Cursor, kind: int, what: str) -> None:
    if kind in _SCALARS:
        cur.skip(_SCALARS[kind][1], what)
    elif kind == _STRING:
        cur.string(what)
    elif kind == _ARRAY:
        item = cur.scalar("I", what)
        count = cur.scalar("Q", what)
        if item in _SCALARS:            # fixed-size items: one jump
            cur.skip(count * _SCALARS[item][1], what)
        elif item in (_STRING, _ARRAY):
            for i in range(count):
                _skip_value(cur, item, f"{what} (item {i} of {count})")
        else:
            raise ValueError(f"{cur.path}: corrupt GGUF file: {what} is an array of unknown "
                             f"value type {item}")
    else:
        raise ValueError(f"{cur.path}: corrupt GGUF file: {what} has unknown value type {kind}")


def check_layout(path: str) -> None:
    """Raise ValueError naming the first metadata key, tensor info or tensor whose bytes lie
    past the end of `path` (or whose type is unknown); return if the whole layout fits."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (starts with {head[:4]!r}, expected "
                             "b'GGUF')")
        read_version(path, head)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            order = ">" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF == 0 else "<"
            cur = _Cursor(path, buf, order)
            cur.pos = 8
            _check(cur, size)


def _check(cur: _Cursor, size: int) -> None:
    num_tensors = cur.scalar("Q", "the tensor count")
    num_keys = cur.scalar("Q", "the metadata key count")
    alignment, key = GGUF_DEFAULT_ALIGNMENT, None
    for i in range(num_keys):
        where = f" (after {key})" if key else ""
        key = cur.string(f"the name of metadata key {i + 1} of {num_keys}{where}")
        kind = cur.scalar("I", f"metadata key {key}")
        if key == "general.alignment" and kind == 4:
            alignment = cur.scalar("I", f"metadata key {key}")
        else:
            _skip_value(cur, kind, f"metadata key {key}")
    tensors, name = [], None
    for i in range(num_tensors):
        where = f" (after {name})" if name else ""
        name = cur.string(f"the name of tensor info {i + 1} of {num_tensors}{where}")
        what = f"the info of tensor {name}"
        num_dims = cur.scalar("I", what)
        if num_dims > MAX_DIMS:
            raise ValueError(f"{cur.path}: corrupt GGUF file: tensor {name} has {num_dims} "
                             f"dimensions (at most {MAX_DIMS})")
        dims = [cur.scalar("Q", what) for _ in range(num_dims)]
        kind = cur.scalar("I", what)
        offset = cur.scalar("Q", what)
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"{cur.path}: corrupt GGUF file: tensor {name} has unknown type "
                             f"{kind}") from None
        tensors.append((name, offset, math.prod(dims) // block * block_bytes))
    if alignment == 0 or alignment & (alignment - 1):
        raise ValueError(f"{cur.path}: corrupt GGUF file: general.alignment {alignment} is not a "
                         "power of two")
    data_start = -(-cur.pos // alignment) * alignment
    for name, offset, nbytes in tensors:
        begin = data_start + offset
        if begin + nbytes > size:
            raise ValueError(f"{cur.path}: truncated GGUF file: tensor {name} needs bytes "
                             f"[{begin}, {begin + nbytes}) but the file has {size}")
