"""Which C++ compiler built a package, and does its code link the C++ runtime?

AOTInductor compiles each program into a shared library with the C++ compiler Inductor picks
(``torch._inductor.cpp_builder.get_cpp_compiler``): the first that answers ``--version`` among
``torch._inductor.config.cpp.cxx``, whose default Inductor reads from the ``CXX`` environment
variable when it is imported (else ``g++``). Some machines set ``CXX`` to a wrapper compiler whose
shared objects do not list ``libstdc++`` among their dependencies; a package built there can crash
inside its library's initializers the moment it is loaded, taking the whole process with it.

So the libraries are judged from their ELF dynamic section before anything loads them: a library
that calls into the C++ runtime (``std::``, ``__cxa_*``, ``operator new``) without a ``DT_NEEDED``
entry for ``libstdc++``/``libc++`` only works where something else already loaded one, and
``load_package`` refuses it with the compiler's name and the fix. ``load_check`` adds the
subprocess load that ``tscompile export`` runs after writing a package.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import struct
import sys
import zipfile
from dataclasses import dataclass

from tscompile.package.elf import read_dynamic

CXX_ENV = "the CXX environment variable"
CXX_CONFIG = "torch._inductor.config.cpp.cxx"
CXX_OPTIONS = "inductor_configs['cpp.cxx']"
CXX_DEFAULT = "Inductor's default"
CXX_SYSTEM_RETRY = "the system g++ on PATH"

# mangled names of the C++ runtime: std:: (St, and the Ss/Sa/Si/So/Sd abbreviations) with their
# typeinfo, vtables and VTTs, __gnu_cxx::, __cxxabiv1::, operator new/delete, and the ABI's __cxa_*
# entry points except the ones glibc itself provides to every C library
_CXX_RUNTIME_SYMBOL = re.compile(
    r"^(?:__cxa_(?!finalize$|atexit$|thread_atexit_impl$|at_quick_exit$)"
    r"|__gxx_personality_"
    r"|_Z(?:T[ISVT])?N?K?(?:S[tsaiod]|9__gnu_cxx|10__cxxabiv1)"
    r"|_Z(?:nw|na|dl|da)[jmPv])"
)
_CXX_RUNTIME_LIBRARY = re.compile(r"^lib(?:stdc\+\+|c\+\+)\.so")
_ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True)
class CompilerChoice:
    """The C++ compiler Inductor runs: ``command`` as Inductor calls it, ``path`` where it resolves
    on ``PATH`` (None if nowhere) and ``source``, the setting it came from."""

    command: str
    path: str | None
    source: str

    def describe(self) -> str:
        shown = self.path or self.command
        return f"{shown} (from {self.source})"

    def as_record(self) -> dict:
        return {"command": self.command, "path": self.path, "source": self.source}

    @classmethod
    def from_record(cls, record: dict) -> CompilerChoice | None:
        c = record.get("compiler")
        if not isinstance(c, dict) or not c.get("command"):
            return None
        return cls(str(c["command"]), c.get("path"), str(c.get("source") or "unknown"))


def _candidates(setting) -> tuple[str, ...]:
    values = setting if isinstance(setting, (list, tuple)) else (setting,)
    return tuple(v for v in values if v)  # None stands for Inductor's opt-in conda install of gcc


def inductor_compiler(options: dict | None = None, *, source: str | None = None) -> CompilerChoice:
    """The compiler an AOTInductor build with ``options`` (``inductor_configs``) would run, and the
    setting it came from: ``CXX_OPTIONS`` when ``options`` set ``cpp.cxx``, ``CXX_ENV`` when the
    config still holds the ``CXX`` value it was built from, ``CXX_DEFAULT`` for plain ``g++``, else
    ``CXX_CONFIG`` (changed by the user). ``source`` overrides the label (a rebuild says why)."""
    import torch._inductor.config as config

    patch = {"cpp.cxx": options["cpp.cxx"]} if options and "cpp.cxx" in options else {}
    with config.patch(patch):
        setting = config.cpp.cxx
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            command = get_cpp_compiler()
        except Exception:  # no candidate answers --version: name the last one, as the build will fail on it
            found = _candidates(setting)
            command = found[-1] if found else "g++"
    if source is None:
        env = os.environ.get("CXX")
        default = "clang++" if sys.platform == "darwin" else "g++"
        if patch:
            source = CXX_OPTIONS
        elif env and command == env and env in _candidates(setting):
            source = CXX_ENV
        elif _candidates(setting) == (default,):
            source = CXX_DEFAULT
        else:
            source = CXX_CONFIG
    return CompilerChoice(command, shutil.which(command), source)


def system_gxx_instead_of(failed: CompilerChoice) -> str | None:
    """The system ``g++`` on ``PATH`` to rebuild with when ``CXX`` chose a compiler whose package
    does not load; None when ``CXX`` did not choose it (the user's explicit config is not
    second-guessed) or when that ``g++`` is the very compiler that failed."""
    if failed.source != CXX_ENV:
        return None
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    if failed.path and os.path.realpath(gxx) == os.path.realpath(failed.path):
        return None
    return gxx


def missing_runtime_libs(so: str | os.PathLike | io.IOBase) -> list[str]:
    """Problems of one shared library (a path or a seekable binary file): empty when it links a C++
    runtime, uses none, or is not an ELF file with section headers; else one clause (its subject
    is the library) saying which C++ runtime symbols it needs and which libraries it lists instead."""
    if isinstance(so, (str, os.PathLike)):
        with open(so, "rb") as f:
            return missing_runtime_libs(f)
    info = read_dynamic(so)
    if info is None:
        return []
    cxx = [s for s in info.undefined if _CXX_RUNTIME_SYMBOL.match(s)]
    if not cxx or any(_CXX_RUNTIME_LIBRARY.match(n) for n in info.needed):
        return []
    example = min(cxx, key=len)
    return [f"calls {len(cxx)} C++ runtime symbols (e.g. {example}) but does not link a C++ runtime "
            f"(its DT_NEEDED libraries: {', '.join(info.needed) or 'none'}; no libstdc++.so)"]


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``size`` bytes at ``offset`` of an open file: a stored zip
    member read in place, so the ELF reader's seeks cost nothing."""

    def __init__(self, f, offset: int, size: int):
        self.f, self.offset, self.size, self.pos = f, offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.size + pos}[whence]
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n < 0 else max(0, min(n, self.size - self.pos))
        self.f.seek(self.offset + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data


def _member_file(zf: zipfile.ZipFile, raw, info: zipfile.ZipInfo):
    if info.compress_type == zipfile.ZIP_STORED:
        raw.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", raw.read(4))
        return _Window(raw, info.header_offset + 30 + name_len + extra_len, info.file_size)
    return io.BytesIO(zf.read(info))


def package_library_problems(path: str | os.PathLike) -> dict[str, list[str]]:
    """``{member: problems}`` for the shared libraries inside a ``.pt2`` that fail
    ``missing_runtime_libs``; read from the archive, nothing extracted or loaded."""
    found = {}
    with open(path, "rb") as raw, zipfile.ZipFile(raw) as zf:
        for info in zf.infolist():
            if not info.filename.endswith(".so"):
                continue
            f = _member_file(zf, raw, info)
            if f.read(4) != _ELF_MAGIC:
                continue
            try:
                problems = missing_runtime_libs(f)
            except (ValueError, struct.error) as e:
                problems = [f"its ELF headers do not read ({e})"]
            if problems:
                found[info.filename] = problems
    return found


def compiler_advice(compiler: CompilerChoice | None) -> str:
    """What to set, for a package whose library does not load or does not link the C++ runtime."""
    gxx = shutil.which("g++") or "/usr/bin/g++"
    if compiler is not None and compiler.source == CXX_ENV:
        return (f"set CXX to a compiler whose shared libraries link libstdc++ (e.g. CXX={gxx}) or unset CXX, "
                f"and export again (tscompile export rebuilds once with the system g++ by itself when CXX "
                f"chose the compiler)")
    if compiler is not None and compiler.source in (CXX_CONFIG, CXX_OPTIONS):
        return (f"set {compiler.source} to a compiler whose shared libraries link libstdc++ (e.g. {gxx}) "
                f"and export again")
    return (f"export it again with a C++ compiler whose shared libraries link libstdc++ (e.g. CXX={gxx}, "
            f"or CXX unset)")


def refuse_unlinked_cxx_runtime(path: str | os.PathLike, record: dict) -> None:
    """``load_package``'s check, before AOTInductor ``dlopen``s anything: refuse a package whose
    library uses the C++ runtime without linking it, naming the compiler the record says built it."""
    problems = package_library_problems(path)
    if not problems:
        return
    member, why = next(iter(problems.items()))
    compiler = CompilerChoice.from_record(record)
    built_by = (f"it was compiled by {compiler.describe()} on the exporting machine" if compiler else
                "the package does not record which compiler built it")
    raise ValueError(f"tscompile: package {os.fspath(path)!r} cannot be loaded safely: its library {member!r} "
                     f"{why[0]}, so loading it can crash inside the library's initializers; {built_by}. "
                     f"To load it, {compiler_advice(compiler)}.")
