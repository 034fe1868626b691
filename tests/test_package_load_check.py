"""Packages that load: the ELF check of a package's libraries (a C++ library must link the C++
runtime it calls), ``load_package``'s refusal of one that does not, the subprocess load that
``tscompile export`` runs after writing a package (a crash becomes a ``tscompile:`` error naming
the compiler and where it came from), and the one rebuild with the system ``g++`` when ``CXX``
chose a compiler whose package does not load.

Real libraries are built with the system ``g++``: normally, and with ``-nodefaultlibs`` (no
``libstdc++`` among its dependencies, as a wrapper compiler on the GPU machine builds them). The
crash itself is simulated with a child that kills itself with SIGSEGV; one slow test runs the
whole export with such a compiler in ``CXX``."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import tscompile
import tscompile.version
from tscompile.package import compiler_check, load_check
from tscompile.package.compiler_check import (CXX_CONFIG, CXX_DEFAULT, CXX_ENV, CXX_OPTIONS, CompilerChoice,
                                              inductor_compiler, missing_runtime_libs, package_library_problems,
                                              refuse_unlinked_cxx_runtime)
from tscompile.package.elf import read_dynamic
from tscompile.package.record import FORMAT_VERSION

GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="needs the system g++ to build test libraries")

_CXX_SOURCE = r"""
#include <stdexcept>
#include <string>
#include <vector>
extern "C" int tscompile_test_entry(int n) {
    std::vector<std::string> v(n, std::string(n, 'x'));
    if (n < 0) throw std::runtime_error("negative");
    return static_cast<int>(v.size());
}
"""
_C_SOURCE = "int tscompile_test_c_entry(int n) { return n + 1; }\n"


def _compile(tmp: Path, name: str, source: str, compiler: str, *flags: str) -> Path:
    src = tmp / f"{name}.{'c' if compiler.endswith('gcc') else 'cpp'}"
    src.write_text(source)
    out = tmp / f"lib{name}.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", str(src), "-o", str(out), *flags], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    """``linked``: C++ built normally; ``unlinked``: the same C++ linked without libstdc++ (it still
    links: a shared object may leave symbols undefined); ``plain_c``: a C library."""
    if GXX is None:
        pytest.skip("needs the system g++ to build test libraries")
    tmp = tmp_path_factory.mktemp("libs")
    made = {"linked": _compile(tmp, "linked", _CXX_SOURCE, GXX),
            "unlinked": _compile(tmp, "unlinked", _CXX_SOURCE, GXX, "-nodefaultlibs", "-lc", "-lm")}
    gcc = shutil.which("gcc")
    if gcc:
        made["plain_c"] = _compile(tmp, "plain_c", _C_SOURCE, gcc)
    return made


def _readelf_needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def _nm_undefined(path: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True,
                         check=True).stdout
    # "U name@VERSION" for a strong undefined symbol; weak ones are "w"/"v"
    return {line.split()[1].split("@")[0] for line in out.splitlines() if line.split()[:1] == ["U"]}


# ---------------------------------------------------------------------------------- the ELF check


@pytest.mark.skipif(not (shutil.which("readelf") and shutil.which("nm")), reason="needs binutils to compare")
def test_elf_reader_agrees_with_readelf_and_nm(libs):
    for path in libs.values():
        with open(path, "rb") as f:
            info = read_dynamic(f)
        assert list(info.needed) == _readelf_needed(path), path.name
        assert set(info.undefined) == _nm_undefined(path), path.name
    # and on a large real library: the torch build's own
    lib = Path(torch.__file__).parent / "lib" / "libtorch_python.so"
    if lib.is_file():
        with open(lib, "rb") as f:
            info = read_dynamic(f)
        assert list(info.needed) == _readelf_needed(lib)
        assert set(info.undefined) == _nm_undefined(lib)


def test_library_linking_libstdcxx_passes(libs):
    with open(libs["linked"], "rb") as f:
        info = read_dynamic(f)
    assert any(n.startswith("libstdc++.so") for n in info.needed)
    assert any(s.startswith(("_ZNSt", "_ZSt", "__cxa_")) for s in info.undefined)  # it does use the runtime
    assert missing_runtime_libs(libs["linked"]) == []


def test_library_without_libstdcxx_is_flagged(libs):
    with open(libs["unlinked"], "rb") as f:
        info = read_dynamic(f)
    assert not any("stdc++" in n for n in info.needed) and "libc.so.6" in info.needed
    problems = missing_runtime_libs(libs["unlinked"])
    assert len(problems) == 1
    assert re.match(r"calls \d+ C\+\+ runtime symbols \(e\.g\. \S+\) but does not link a C\+\+ runtime "
                    r"\(its DT_NEEDED libraries: .*libc\.so\.6.*; no libstdc\+\+\.so\)", problems[0]), problems[0]


def test_c_library_and_non_elf_files_are_not_flagged(libs):
    if "plain_c" in libs:  # references glibc's __cxa_finalize (weak), which is no C++ runtime
        assert missing_runtime_libs(libs["plain_c"]) == []
    assert read_dynamic(io.BytesIO(b"#!/bin/sh\necho not a library\n")) is None
    assert missing_runtime_libs(io.BytesIO(b"\x7fELF\x01\x01" + b"\0" * 58)) == []  # 32-bit: not judged
    with pytest.raises(ValueError, match="truncated ELF"):
        read_dynamic(io.BytesIO(libs["linked"].read_bytes()[:200]))


@pytest.mark.parametrize("symbol,runtime", [
    ("_ZNSt13runtime_errorC1EPKc", True), ("_ZSt9terminatev", True), ("_ZTISt9exception", True),
    ("_ZTVN10__cxxabiv117__class_type_infoE", True), ("_Znwm", True), ("_ZdlPvm", True), ("__cxa_throw", True),
    ("__gxx_personality_v0", True), ("_ZNKSt5ctypeIcE13_M_widen_initEv", True), ("_ZNSo3putEc", True),
    ("__cxa_finalize", False), ("__cxa_atexit", False), ("_ZN3c1010TensorImpl7releaseEv", False),
    ("_ZNK2at10TensorBase4sizeEl", False), ("memcpy", False), ("aoti_torch_empty_strided", False),
])
def test_cxx_runtime_symbol_names(symbol, runtime):
    assert bool(compiler_check._CXX_RUNTIME_SYMBOL.match(symbol)) is runtime


# ------------------------------------------------------------------- package members, load_package


def _fake_package(path: Path, so: Path, *, compressed: bool = False, compiler: dict | None = None) -> Path:
    """A ``.pt2`` laid out like an export, with a record that passes every check ``load_package``
    makes before the library check, and ``so`` as the prefill program's library."""
    record = {"format": FORMAT_VERSION, "tscompile_version": tscompile.version.__version__,
              "torch_version": torch.__version__, "device": "cpu", "dtype": "float32", "weights": "inside",
              "pages_per_block": 1, "bounds": {"max_num_seqs": 2, "max_model_len": 32, "max_num_batched_tokens": 16}}
    if compiler is not None:
        record["compiler"] = compiler
    mode = zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=mode) as zf:
        zf.writestr("m/data/aotinductor/prefill/model.wrapper.cpp", "// source\n")
        zf.write(so, "m/data/aotinductor/prefill/model.wrapper.so")
        zf.writestr("m/extra/tscompile.json", json.dumps(record))
    return path


@pytest.mark.parametrize("compressed", [False, True])
def test_package_library_problems_reads_members_in_place(libs, tmp_path, compressed):
    good = _fake_package(tmp_path / "good.pt2", libs["linked"], compressed=compressed)
    bad = _fake_package(tmp_path / "bad.pt2", libs["unlinked"], compressed=compressed)
    assert package_library_problems(good) == {}
    problems = package_library_problems(bad)
    assert list(problems) == ["m/data/aotinductor/prefill/model.wrapper.so"]
    assert "does not link a C++ runtime" in problems["m/data/aotinductor/prefill/model.wrapper.so"][0]


def test_load_package_refuses_unlinked_library_before_loading_it(libs, tmp_path, monkeypatch):
    """The refusal names the library, the compiler the record names and its source, and the fix;
    AOTInductor is never asked to load the library."""
    import tscompile.package.runtime as runtime

    def must_not_load(*a, **k):
        raise AssertionError("the library was handed to AOTInductor")

    monkeypatch.setattr(runtime, "_load_programs", must_not_load)
    compiler = {"command": "/opt/wrap/c++", "path": "/opt/wrap/c++", "source": CXX_ENV}
    bad = _fake_package(tmp_path / "bad.pt2", libs["unlinked"], compiler=compiler)
    with pytest.raises(ValueError, match=r"^tscompile: package .*bad\.pt2.* cannot be loaded safely: its library "
                                         r"'m/data/aotinductor/prefill/model\.wrapper\.so' calls \d+ C\+\+ runtime "
                                         r"symbols .* does not link a C\+\+ runtime") as e:
        tscompile.load_package(bad)
    msg = str(e.value)
    assert "compiled by /opt/wrap/c++ (from the CXX environment variable)" in msg
    assert "set CXX to a compiler whose shared libraries link libstdc++" in msg and "unset CXX" in msg
    assert "\n" not in msg  # the CLI prints a refusal's first line only
    # an older package without the compiler in its record is refused all the same
    with pytest.raises(ValueError, match=r"does not record which compiler built it"):
        tscompile.load_package(_fake_package(tmp_path / "old.pt2", libs["unlinked"]))
    # while a package whose library links libstdc++ passes the check and reaches AOTInductor
    with pytest.raises(AssertionError, match="handed to AOTInductor"):
        tscompile.load_package(_fake_package(tmp_path / "good.pt2", libs["linked"], compiler=compiler))


def test_refusal_without_a_record_compiler_advises_a_compiler_that_links(libs, tmp_path):
    bad = _fake_package(tmp_path / "bad.pt2", libs["unlinked"])
    with pytest.raises(ValueError, match=r"To load it, export it again with a C\+\+ compiler whose shared "
                                         r"libraries link libstdc\+\+"):
        refuse_unlinked_cxx_runtime(bad, {})


# ------------------------------------------------------------------------ which compiler, and why


@pytest.fixture
def wrapper_cxx(tmp_path) -> str:
    """A compiler wrapper (answers --version, compiles with g++), named like g++ as Inductor's flag
    choice keys on the name."""
    if GXX is None:
        pytest.skip("needs the system g++")
    path = tmp_path / "wrap-g++"
    path.write_text(f'#!/bin/sh\nexec {GXX} "$@"\n')
    path.chmod(0o755)
    return str(path)


def _use_cxx(monkeypatch, cxx: str) -> None:
    """What setting CXX before starting Python does: Inductor's config reads it at import."""
    import torch._inductor.config as config

    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setattr(config.cpp, "cxx", (None, cxx))


def test_inductor_compiler_names_its_source(wrapper_cxx, monkeypatch):
    import torch._inductor.config as config

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(config.cpp, "cxx", (None, "g++"))
    assert inductor_compiler() == CompilerChoice("g++", GXX, CXX_DEFAULT)
    assert inductor_compiler({"cpp.cxx": (wrapper_cxx,)}) == CompilerChoice(wrapper_cxx, wrapper_cxx, CXX_OPTIONS)
    monkeypatch.setattr(config.cpp, "cxx", (wrapper_cxx,))
    assert inductor_compiler() == CompilerChoice(wrapper_cxx, wrapper_cxx, CXX_CONFIG)
    _use_cxx(monkeypatch, wrapper_cxx)
    choice = inductor_compiler()
    assert choice == CompilerChoice(wrapper_cxx, wrapper_cxx, CXX_ENV)
    assert compiler_check.system_gxx_instead_of(choice) == GXX
    # CXX set after Inductor read its config changes nothing, and is not blamed
    monkeypatch.setattr(config.cpp, "cxx", (None, "g++"))
    assert inductor_compiler().source == CXX_DEFAULT
    assert compiler_check.system_gxx_instead_of(inductor_compiler()) is None


def test_no_rebuild_when_cxx_already_is_the_system_gxx(monkeypatch):
    monkeypatch.setenv("CXX", GXX or "g++")
    choice = CompilerChoice(GXX or "g++", GXX, CXX_ENV)
    assert compiler_check.system_gxx_instead_of(choice) is None


# ------------------------------------------------------------------------- the subprocess check


_SEGFAULT = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
_SUCCEED = [sys.executable, "-c", "pass"]


def _children(monkeypatch, *commands: list[str]) -> list[tuple]:
    """Replace the child load with ``commands``, one per check in turn; returns the calls seen."""
    calls, queue = [], list(commands)

    def command(path, device):
        calls.append((os.fspath(path), device))
        return queue.pop(0)

    monkeypatch.setattr(load_check, "load_command", command)
    return calls


def test_crashing_load_becomes_a_tscompile_error_naming_the_compiler(wrapper_cxx, monkeypatch, tmp_path):
    _use_cxx(monkeypatch, wrapper_cxx)
    calls = _children(monkeypatch, _SEGFAULT)
    path = tmp_path / "m.pt2"
    with pytest.raises(ValueError) as e:
        load_check.verify_loads_in_subprocess(path, "cpu", inductor_compiler())
    msg = str(e.value)
    assert msg.startswith(f"tscompile: package {os.fspath(path)!r} does not load: loading it in a fresh process "
                          f"crashed with SIGSEGV (signal {int(signal.SIGSEGV)})")
    assert f"compiled by {wrapper_cxx} (from the CXX environment variable)" in msg
    assert f"CXX={GXX}" in msg and "unset CXX" in msg and "--no-verify" in msg
    assert "\n" not in msg
    assert calls == [(os.fspath(path), "cpu")]


def test_failing_load_reports_the_childs_refusal_or_its_last_lines(monkeypatch, tmp_path):
    compiler = CompilerChoice("g++", GXX, CXX_DEFAULT)
    refusal = ("import sys; sys.stderr.write('Traceback ...\\nValueError: tscompile: package x cannot be loaded "
               "safely: its library y calls 3 C++ runtime symbols. To load it, set CXX.\\n'); sys.exit(1)")
    _children(monkeypatch, [sys.executable, "-c", refusal],
              [sys.executable, "-c", "import sys; sys.stderr.write('one\\ntwo\\nthree\\nfour\\n'); sys.exit(3)"])
    with pytest.raises(ValueError, match=r"^tscompile: .* failed with exit status 1: package x cannot be loaded "
                                         r"safely: its library y calls 3 C\+\+ runtime symbols\. Its C\+\+ code"):
        load_check.verify_loads_in_subprocess(tmp_path / "m.pt2", "cpu", compiler)
    with pytest.raises(ValueError, match=r"failed with exit status 3: two \| three \| four\. .*compiled by "
                                         r".*\(from Inductor's default\)"):
        load_check.verify_loads_in_subprocess(tmp_path / "m.pt2", "cpu", compiler)


def test_long_child_refusal_keeps_its_start_and_other_output_its_end():
    long = "tscompile: package x cannot be loaded safely: " + "y" * 3000
    assert load_check._gist(f"Traceback\nValueError: {long}\n").startswith("package x cannot be loaded safely: yyy")
    assert load_check._gist("a\n" + "z" * 3000 + "END\n").endswith("zzzEND")


def test_hanging_load_is_cut_off(monkeypatch, tmp_path):
    _children(monkeypatch, [sys.executable, "-c", "import time; time.sleep(30)"])
    assert load_check.load_failure(tmp_path / "m.pt2", "cpu", timeout=1) == (
        "loading it in a fresh process did not finish within 1 s")


def test_retry_with_system_gxx_when_cxx_chose_the_compiler(wrapper_cxx, monkeypatch, tmp_path, caplog):
    _use_cxx(monkeypatch, wrapper_cxx)
    calls = _children(monkeypatch, _SEGFAULT, _SUCCEED)
    rebuilt = []

    def rebuild(cxx):
        rebuilt.append(cxx)
        return CompilerChoice(cxx, cxx, compiler_check.CXX_SYSTEM_RETRY)

    with caplog.at_level(logging.WARNING, logger="tscompile"):
        final = load_check.ensure_package_loads(tmp_path / "m.pt2", "cpu", inductor_compiler(), rebuild)
    assert rebuilt == [GXX] and len(calls) == 2 and final.command == GXX
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert re.match(rf"tscompile: the package built with CXX={re.escape(wrapper_cxx)} does not load \(loading it "
                    rf"in a fresh process crashed with SIGSEGV.*\); rebuilding once with the system g\+\+ "
                    rf"{re.escape(GXX)}$", warnings[0])
    assert warnings[1].startswith(f"tscompile: the package rebuilt with the system g++ {GXX} loads")


def test_retry_that_still_fails_names_both_builds(wrapper_cxx, monkeypatch, tmp_path):
    _use_cxx(monkeypatch, wrapper_cxx)
    _children(monkeypatch, _SEGFAULT, [sys.executable, "-c", "import sys; sys.exit('still broken')"])
    rebuild = lambda cxx: CompilerChoice(cxx, cxx, compiler_check.CXX_SYSTEM_RETRY)  # noqa: E731
    with pytest.raises(ValueError, match=rf"^tscompile: package .* does not load: loading it in a fresh process "
                                         rf"failed with exit status 1: still broken\. The first build, with "
                                         rf"CXX={re.escape(wrapper_cxx)}, did not load either \(.*SIGSEGV.*\)\. Its "
                                         rf"C\+\+ code was compiled by {re.escape(GXX)} \(from the system g\+\+ on "
                                         rf"PATH\)"):
        load_check.ensure_package_loads(tmp_path / "m.pt2", "cpu", inductor_compiler(), rebuild)


def test_no_retry_when_cxx_did_not_choose_the_compiler(monkeypatch, tmp_path):
    """A compiler the user set in Inductor's config is not second-guessed: refused at once."""
    _children(monkeypatch, _SEGFAULT)

    def rebuild(cxx):
        raise AssertionError("rebuilt")

    compiler = CompilerChoice("/opt/cc/g++", "/opt/cc/g++", CXX_CONFIG)
    with pytest.raises(ValueError, match=r"^tscompile: .* crashed with SIGSEGV") as e:
        load_check.ensure_package_loads(tmp_path / "m.pt2", "cpu", compiler, rebuild)
    assert "compiled by /opt/cc/g++ (from torch._inductor.config.cpp.cxx)" in str(e.value)
    assert "set torch._inductor.config.cpp.cxx to a compiler whose shared libraries link libstdc++" in str(e.value)


def test_export_cli_verifies_unless_no_verify(monkeypatch, tmp_path, capsys):
    import tscompile.export
    from tscompile.cli import main as cli_main

    seen = []

    def fake_export(model, out, **kwargs):
        seen.append(kwargs["verify"])
        Path(out).write_bytes(b"x")
        return {"weights": "inside", "bounds": {"max_num_seqs": 1, "max_model_len": 8, "max_num_batched_tokens": 4},
                "device": "cpu", "dtype": "float32", "attention_backend": "torch", "page_size": 4,
                "compiler": {"command": "g++", "path": "/usr/bin/g++", "source": CXX_DEFAULT}}

    monkeypatch.setattr(tscompile.export, "export_package", fake_export)
    out = str(tmp_path / "m.pt2")
    assert cli_main(["export", "--out", out, "--device", "cpu"]) == 0
    assert "C++ compiler /usr/bin/g++; loads (checked in a fresh process)" in capsys.readouterr().out
    assert cli_main(["export", "--out", out, "--device", "cpu", "--no-verify"]) == 0
    assert "load not checked (--no-verify)" in capsys.readouterr().out
    assert seen == [True, False]


# ------------------------------------------------------------------ one real export, CXX broken


@pytest.mark.slow
@needs_gxx
def test_export_with_a_cxx_that_drops_libstdcxx_rebuilds_with_system_gxx(tmp_path, monkeypatch, caplog):
    """The GPU machine's case on a CPU: CXX names a wrapper whose shared objects do not link
    libstdc++. The export's check refuses its package (the child's load_package finds the
    unlinked library), rebuilds once with the system g++, and the package written loads here and
    generates what the eager engine does; the first build's package is refused by load_package."""
    from tscompile.export import export_package, read_package_metadata
    from helpers import ids

    fake = tmp_path / "nolibstdcxx-g++"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -shared ] && exec {GXX} "$@" -nodefaultlibs -lc -lm; '
                    f'done\nexec {GXX} "$@"\n')
    fake.chmod(0o755)
    _use_cxx(monkeypatch, str(fake))
    first_build = tmp_path / "first.pt2"
    real_failure = load_check.load_failure

    def keep_first_build(path, device, **kw):  # the first build is overwritten by the rebuild: keep a copy
        if not first_build.exists():
            shutil.copy(path, first_build)
        return real_failure(path, device, **kw)

    monkeypatch.setattr(load_check, "load_failure", keep_first_build)
    out = tmp_path / "tiny.pt2"
    bounds = dict(max_num_seqs=2, max_model_len=24, page_size=4, max_num_batched_tokens=8)
    with caplog.at_level(logging.INFO, logger="tscompile"):
        record = export_package("llama-tiny", out, device="cpu", dtype=torch.float32, **bounds)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"tscompile: the package built with CXX={fake} does not load (loading it in a "
                                  f"fresh process failed with exit status 1: package ")
    assert "does not link a C++ runtime" in warnings[0] and warnings[0].endswith(f"the system g++ {GXX}")
    # the export's second check, of the rebuilt package, loaded it in a fresh process
    assert warnings[1].startswith(f"tscompile: the package rebuilt with the system g++ {GXX} loads; it replaces the "
                                  f"one built with CXX={fake}")
    assert record["compiler"] == {"command": GXX, "path": GXX, "source": compiler_check.CXX_SYSTEM_RETRY}
    assert read_package_metadata(out)["compiler"] == record["compiler"]
    assert package_library_problems(out) == {}
    llm = tscompile.load_package(out)
    eager = tscompile.LLM("llama-tiny", device="cpu", dtype=torch.float32, enforce_eager=True, **bounds)
    prompts = [[5, 17, 3, 99], [300]]
    params = tscompile.SamplingParams(max_new_tokens=4)
    assert ids(llm.generate(prompts, params)) == ids(eager.generate(prompts, params))

    assert package_library_problems(first_build)
    with pytest.raises(ValueError, match=rf"^tscompile: package .*first\.pt2.* cannot be loaded safely: .* compiled "
                                         rf"by {re.escape(str(fake))} \(from the CXX environment variable\)"):
        tscompile.load_package(first_build)
