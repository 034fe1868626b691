"""The package's metadata record (``tscompile.json`` inside the ``.pt2``): what was built, for what,
with what; read and checked before any program is loaded."""

from __future__ import annotations

import json
import os
import zipfile

import torch

from tscompile.package.integrity import check_archive_crc, check_external_weights, weights_path  # noqa: F401

# 2: the record holds the external weights file's size and SHA-256 (weights_bytes, weights_sha256)
FORMAT_VERSION = 2
METADATA_FILE = "tscompile.json"
TOKENIZER_PREFIX = "tokenizer/"  # extra files of a package exported from a checkpoint: its tokenizer


def read_package_metadata(path: str | os.PathLike, *, check_integrity: bool = True, verify: bool = False) -> dict:
    """The package's ``tscompile.json`` record, read without loading any program.

    ``check_integrity`` (the default) first reads every program and metadata member against its
    CRC-32 and, for ``--weights external``, checks the weights file's safetensors header and size;
    ``verify`` also reads the tensor data (the CRC-32 of weights inside, the SHA-256 of an external
    file against the export's): slow for a large model. Each refusal is a
    ``ValueError('tscompile: ...')`` naming the damaged member or file."""

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"tscompile: no package at {path!r}")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"tscompile: {path!r} is not a .pt2 package (not a zip archive)")
    if check_integrity:
        check_archive_crc(path, tensors=verify)
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith(f"extra/{METADATA_FILE}")]
            if not names:
                raise ValueError(f"tscompile: {path!r} is not a tscompile package (no extra/{METADATA_FILE})")
            text = zf.read(names[0])
    except zipfile.BadZipFile:
        raise ValueError(f"tscompile: {path!r} is not a .pt2 package (not a zip archive)") from None
    try:
        record = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"tscompile: package {path!r} is damaged: member {names[0]!r} is not valid JSON "
                         f"({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"tscompile: package {path!r} is damaged: member {names[0]!r} is not a JSON object")
    if check_integrity:
        check_external_weights(path, record, verify=verify)
    return record


def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def check_compatible(record: dict, device: torch.device) -> None:
    """Refuse (``ValueError('tscompile: ...')``) a package this process cannot run: another format,
    another tscompile or torch release (major.minor; the programs link this torch's runtime and call
    this tscompile's ops), or another device type."""
    from tscompile.version import __version__

    if record.get("format") != FORMAT_VERSION:
        raise ValueError(f"tscompile: package format {record.get('format')} is not supported "
                         f"(this tscompile reads format {FORMAT_VERSION}); re-export the model")
    built, here = record["tscompile_version"], __version__
    if _release(built) != _release(here):
        raise ValueError(f"tscompile: package was built with tscompile {built}, this is tscompile {here} "
                         f"(releases {'.'.join(map(str, _release(built)))} and "
                         f"{'.'.join(map(str, _release(here)))} are incompatible); re-export the model")
    built, here = record["torch_version"], torch.__version__
    if _release(built) != _release(here):
        raise ValueError(f"tscompile: package was built with torch {built}, this is torch {here} "
                         f"(AOTInductor programs need the same major.minor release); re-export the model")
    if device.type != record["device"]:
        raise ValueError(f"tscompile: package was built for device {record['device']!r}, cannot load it on "
                         f"{device.type!r}; export it again with --device {device.type}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("tscompile: package was built for device 'cuda', but CUDA is not available here")

