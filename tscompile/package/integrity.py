"""Is a package intact? Checks run before AOTInductor touches the files, so a damaged package is
refused with a ``tscompile:`` error naming the broken part instead of crashing the loader.

The default checks stay cheap enough for every load, whatever the model's size: each program and
metadata member is read once through ``zipfile`` (which compares it with the CRC-32 the archive
records), and an external weights file gets its safetensors header parsed and its size compared
with what that header declares, without reading any tensor. ``verify=True`` also reads the tensor
data: the CRC-32 of weights stored inside the archive, and the SHA-256 of an external weights file
compared with the hash recorded at export. Only it catches a flipped byte inside tensor data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zipfile
import zlib
from pathlib import Path

_CHUNK = 1 << 20
# a safetensors header is a few hundred bytes per tensor; anything near this is a garbled length
_MAX_HEADER_BYTES = 100 * 2**20
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


# where a .pt2 keeps tensor data (torch.export's archive layout): the bulk of a --weights inside
# package, so its CRC-32 pass is part of verify=True and not of every load
_TENSOR_DIRS = ("data/weights/", "data/constants/", "xl_model_weights/")


def is_tensor_member(name: str) -> bool:
    return any(f"/{d}" in f"/{name}" for d in _TENSOR_DIRS)


def check_archive_crc(path: str | os.PathLike, *, tensors: bool = True) -> None:
    """Read the members of the ``.pt2`` zip, refusing the first one whose bytes fail its CRC-32 (or
    cannot be read at all: a garbled local header, a truncated archive). ``tensors=False`` skips
    the tensor data members, which hold nearly all the bytes of a package with its weights inside."""
    path = os.fspath(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"tscompile: {path!r} is not a .pt2 package (not a readable zip archive: {e})") from None
    with zf:
        for info in zf.infolist():
            if not tensors and is_tensor_member(info.filename):
                continue
            try:
                with zf.open(info) as member:
                    while member.read(_CHUNK):
                        pass
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError) as e:
                raise ValueError(f"tscompile: package {path!r} is damaged: member {info.filename!r} fails its "
                                 f"CRC-32 check or cannot be read ({e}); re-export or copy it again") from None


def safetensors_data_bytes(path: str | os.PathLike) -> int:
    """Parse a safetensors header (8-byte little-endian length, then JSON) and return the file size
    it implies; refuses a header that does not parse or describes tensors inconsistently."""
    path = os.fspath(path)
    size = os.path.getsize(path)

    def garbled(why: str) -> ValueError:
        return ValueError(f"tscompile: weights file {path!r} is damaged: {why}; re-export or copy it again")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise garbled(f"{size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise garbled(f"its header claims {n} bytes but the file holds {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise garbled(f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise garbled("its header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            itemsize = _DTYPE_BYTES[entry["dtype"]]
            begin, stop = (int(x) for x in entry["data_offsets"])
            numel = math.prod(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise garbled(f"the header entry of tensor {name!r} is malformed ({entry!r})") from None
        if not 0 <= begin <= stop or stop - begin != numel * itemsize:
            raise garbled(f"tensor {name!r} spans bytes [{begin}, {stop}), which does not fit its "
                          f"{entry['dtype']} shape {entry['shape']}")
        end = max(end, stop)
    return 8 + n + end


def check_weights_file(path: str | os.PathLike, expected_bytes: int | None = None) -> None:
    """Refuse a truncated, extended or garbled safetensors file, reading only its header."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    declared = safetensors_data_bytes(path)
    if size != declared:
        state = "truncated" if size < declared else "longer than its header declares"
        raise ValueError(f"tscompile: weights file {path!r} is damaged: {state} ({size} bytes, its header declares "
                         f"{declared}); re-export or copy it again")
    if expected_bytes is not None and size != expected_bytes:
        raise ValueError(f"tscompile: weights file {path!r} holds {size} bytes, but the package was exported with "
                         f"{expected_bytes}; it belongs to another export")


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weights_path(package: str | os.PathLike) -> Path:
    """Where ``--weights external`` keeps the weights: beside the package, ``<name>.safetensors``."""
    return Path(package).with_suffix(".safetensors")


def verify_weights_sha256(package: str | os.PathLike, record: dict) -> None:
    """The ``verify=True`` check: hash the external weights file and compare with the export's hash.
    Reads the whole file, so it is opt-in. A package with its weights inside has nothing to hash:
    its members' CRC-32s already cover them."""
    if record.get("weights") != "external":
        return
    path = os.fspath(weights_path(package))
    expected = record.get("weights_sha256")
    if not expected:
        raise ValueError(f"tscompile: package {os.fspath(package)!r} records no weights hash, so verify=True cannot "
                         f"check {path!r}; re-export the model")
    actual = file_sha256(path)
    if actual != expected:
        raise ValueError(f"tscompile: weights file {path!r} is damaged: its SHA-256 {actual[:16]}... differs from "
                         f"the {expected[:16]}... recorded at export; re-export or copy it again")


def check_external_weights(path: str | os.PathLike, record: dict, *, verify: bool = False) -> None:
    """For a package exported with ``--weights external``: refuse a missing, truncated or garbled
    weights file (header only); with ``verify``, also one whose SHA-256 differs from the export's."""
    if record.get("weights") != "external":
        return
    wpath = weights_path(path)
    if not Path(wpath).is_file():
        raise ValueError(f"tscompile: package {os.fspath(path)!r} was exported with --weights external, but its "
                         f"weights file {os.fspath(wpath)!r} is missing")
    check_weights_file(wpath, record.get("weights_bytes"))
    if verify:
        verify_weights_sha256(path, record)


def check_package_integrity(path: str | os.PathLike, record: dict, *, verify: bool = False) -> None:
    """Refuse (``ValueError('tscompile: ...')``) a damaged package: a program or metadata member
    failing its CRC-32, or an external weights file that is missing, truncated or has a garbled
    header; with ``verify``, also a tensor data member failing its CRC-32 and an external weights
    file whose SHA-256 differs from the export's."""
    check_archive_crc(path, tensors=verify)
    check_external_weights(path, record, verify=verify)
