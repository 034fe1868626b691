"""``tscompile export`` says what it is doing: a line per phase through the ``tscompile`` logger at
INFO, as the phase starts and with its seconds when it ends, shown by the CLI by default. The slow
parts (``torch.export``, the AOTInductor build, the load check) are stand-ins here that record their
order; test_export.py runs the real export."""

from __future__ import annotations

import logging
import re

import pytest

from tscompile.cli import main as cli_main
from tscompile.package import build, programs


@pytest.fixture
def stand_ins(monkeypatch):
    """The export's slow calls replaced by ones that note their name and write a file where a package
    would be; returns the notes."""
    calls = []

    def export(module, args, dynamic_shapes=None, strict=False):
        calls.append(("export", type(module).__name__))
        return object()

    monkeypatch.setattr(programs.torch.export, "export", export)
    monkeypatch.setattr(build, "program_ops", lambda ep: [])
    monkeypatch.setattr(build, "_aoti_compile", lambda ep, args, options: calls.append(("aoti",)) or [])
    monkeypatch.setattr(build, "_write_package", lambda out, files, record, tok: open(out, "wb").close())
    monkeypatch.setattr(build, "ensure_package_loads", lambda *a: calls.append(("load check",)))
    return calls


PHASES = [r"loading llama-tiny \(cpu, float32\)", r"exporting the prefill program \(torch\.export\)",
          r"exporting the decode program \(torch\.export\)", r"compiling the prefill program with AOTInductor",
          r"compiling the decode program with AOTInductor", r"writing .*tiny\.pt2",
          r"checking that the package loads .*"]


def _assert_phases(lines: list[str]) -> None:
    """Each phase twice, in order: when it starts and, with its seconds, when it ends."""
    want = [p for phase in PHASES for p in (rf"^tscompile export: {phase} \.\.\.$",
                                            rf"^tscompile export: {phase} done in \d+\.\d s$")]
    assert len(lines) == len(want), lines
    for line, pattern in zip(lines, want):
        assert re.match(pattern, line), (line, pattern)


def test_export_package_logs_each_phase_with_its_seconds(stand_ins, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tscompile"):
        build.export_package("llama-tiny", tmp_path / "tiny.pt2", device="cpu", max_num_seqs=2, max_model_len=32)
    _assert_phases([r.getMessage() for r in caplog.records if r.getMessage().startswith("tscompile export:")])
    assert stand_ins == [("export", "PrefillProgram"), ("export", "DecodeProgram"), ("aoti",), ("aoti",),
                         ("load check",)]


def test_the_cli_shows_the_phases_on_stderr_by_default(stand_ins, tmp_path, capsys):
    out = tmp_path / "tiny.pt2"
    assert cli_main(["export", "--model", "llama-tiny", "--out", str(out), "--device", "cpu", "--max-num-seqs", "2",
                     "--max-model-len", "32"]) == 0
    captured = capsys.readouterr()
    _assert_phases([line for line in captured.err.splitlines() if line.startswith("tscompile export:")])
    assert f"wrote {out}" in captured.out
