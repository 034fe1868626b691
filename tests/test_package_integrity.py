"""Damaged packages are refused before AOTInductor reads them: a member failing its CRC-32, a
truncated or garbled external weights file, and (only with ``verify=True``) a flipped byte inside
the weights' tensor data. Synthetic ``.pt2``-like zips keep these fast; a real package's record
and damage are checked in test_export.py, over the external-weights package its tests share."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tscompile.package.integrity import check_package_integrity, file_sha256
from tscompile.package.record import FORMAT_VERSION, read_package_metadata
from helpers import flip_byte as _flip, member_offset as _member_offset

MEMBER = "m/data/aotinductor/prefill/wrapper.so"
WEIGHT_MEMBER = "m/data/weights/weight_0"


def _fake_package(path: Path, *, external: bool) -> Path:
    """A stored (uncompressed) zip laid out like a .pt2, with a record and, if ``external``, a small
    safetensors file beside it whose size and hash the record carries, as ``export_package`` writes."""
    record = {"format": FORMAT_VERSION, "weights": "external" if external else "inside"}
    if external:
        wpath = path.with_suffix(".safetensors")
        save_file({"a.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8),
                   "b.bias": torch.ones(8, dtype=torch.float32)}, os.fspath(wpath))
        record.update(weights_bytes=wpath.stat().st_size, weights_sha256=file_sha256(wpath))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(MEMBER, bytes(range(256)) * 64)
        if not external:
            zf.writestr(WEIGHT_MEMBER, bytes(range(256)) * 64)
        zf.writestr("m/extra/tscompile.json", json.dumps(record))
    return path


def test_intact_fake_package_reads(tmp_path):
    path = _fake_package(tmp_path / "ok.pt2", external=True)
    record = read_package_metadata(path, verify=True)
    assert record["weights"] == "external"
    check_package_integrity(path, record, verify=True)


def test_flipped_byte_in_a_member_is_refused_naming_the_member(tmp_path):
    path = _fake_package(tmp_path / "bad.pt2", external=False)
    _flip(path, _member_offset(path, MEMBER) + 8000)  # the middle of the 16 KiB member
    with pytest.raises(ValueError, match=rf"^tscompile: package .*bad\.pt2.* is damaged: member '{MEMBER}' "
                                         r"fails its CRC-32 check"):
        read_package_metadata(path)
    # an inspection that opts out of the check still reads the record
    assert read_package_metadata(path, check_integrity=False)["weights"] == "inside"


def test_flipped_byte_in_weights_inside_is_caught_only_by_verify(tmp_path):
    path = _fake_package(tmp_path / "bad.pt2", external=False)
    _flip(path, _member_offset(path, WEIGHT_MEMBER) + 8000)
    read_package_metadata(path)  # the default pass skips tensor data: a large model loads without a full read
    with pytest.raises(ValueError, match=rf"^tscompile: package .* is damaged: member '{WEIGHT_MEMBER}' fails"):
        read_package_metadata(path, verify=True)


def test_damaged_record_member_is_refused(tmp_path):
    path = _fake_package(tmp_path / "bad.pt2", external=False)
    _flip(path, _member_offset(path, "m/extra/tscompile.json") + 5)
    with pytest.raises(ValueError, match=r"member 'm/extra/tscompile\.json' fails its CRC-32 check"):
        read_package_metadata(path)


def test_truncated_weights_file_is_refused_naming_it(tmp_path):
    path = _fake_package(tmp_path / "m.pt2", external=True)
    wpath = path.with_suffix(".safetensors")
    wpath.write_bytes(wpath.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"^tscompile: weights file .*m\.safetensors.* is damaged: truncated"):
        read_package_metadata(path)


def test_extended_weights_file_is_refused(tmp_path):
    path = _fake_package(tmp_path / "m.pt2", external=True)
    wpath = path.with_suffix(".safetensors")
    wpath.write_bytes(wpath.read_bytes() + b"\0" * 4)
    with pytest.raises(ValueError, match=r"is damaged: longer than its header declares"):
        read_package_metadata(path)


@pytest.mark.parametrize("where,why", [(0, "header claims"), (9, "not valid JSON")])
def test_garbled_weights_header_is_refused(tmp_path, where, why):
    path = _fake_package(tmp_path / "m.pt2", external=True)
    wpath = path.with_suffix(".safetensors")
    _flip(wpath, where + (7 if where == 0 else 0))  # 0: the length's top byte; 9: inside the JSON
    with pytest.raises(ValueError, match=rf"^tscompile: weights file .*m\.safetensors.* is damaged: .*{why}"):
        read_package_metadata(path)


def test_missing_weights_file_is_refused(tmp_path):
    path = _fake_package(tmp_path / "m.pt2", external=True)
    path.with_suffix(".safetensors").unlink()
    with pytest.raises(ValueError, match=r"^tscompile: .*--weights external.*m\.safetensors.* is missing"):
        read_package_metadata(path)


def test_flipped_tensor_byte_is_caught_only_by_verify(tmp_path):
    path = _fake_package(tmp_path / "m.pt2", external=True)
    wpath = path.with_suffix(".safetensors")
    _flip(wpath, wpath.stat().st_size - 3)  # inside the last tensor's data: header and size unchanged
    read_package_metadata(path)  # the default, header-only check cannot see it
    with pytest.raises(ValueError, match=r"^tscompile: weights file .*m\.safetensors.* is damaged: its SHA-256"):
        read_package_metadata(path, verify=True)


def test_verify_refuses_a_record_without_a_hash(tmp_path):
    path = _fake_package(tmp_path / "m.pt2", external=True)
    record = read_package_metadata(path)
    del record["weights_sha256"]
    with pytest.raises(ValueError, match=r"^tscompile: package .* records no weights hash"):
        check_package_integrity(path, record, verify=True)
