"""Just enough of an ELF reader to tell what a shared library needs from the dynamic linker: its
``DT_NEEDED`` libraries and the dynamic symbols it leaves undefined.

Pure Python on a seekable file (a path's file or a member opened inside the ``.pt2`` zip), so a
package's libraries are inspected without extracting them, without binutils (``readelf``/``nm``
are not on every machine that loads a package) and without the dynamic linker itself: a library
built wrong can crash inside its initializers the moment it is ``dlopen``-ed, so it must be judged
before that. Only the section headers are read (``.dynamic``, ``.dynsym`` and their string tables);
a library stripped of them reads as ``None`` (unknown), never as a problem.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

_MAGIC = b"\x7fELF"
_SHT_DYNAMIC, _SHT_DYNSYM = 6, 11
_DT_NULL, _DT_NEEDED = 0, 1
_SHN_UNDEF = 0
_STB_WEAK = 2  # a weak undefined symbol may stay unresolved: loading never fails for it


@dataclass(frozen=True)
class DynamicInfo:
    needed: tuple[str, ...]  # DT_NEEDED, in order
    undefined: tuple[str, ...]  # undefined global (non-weak) dynamic symbols, without version suffix


class _Layout:
    """Field formats of one ELF class (32/64-bit) and byte order."""

    def __init__(self, is64: bool, little: bool):
        e = "<" if little else ">"
        if is64:
            self.header = struct.Struct(e + "HHIQQQIHHHHHH")
            self.section = struct.Struct(e + "IIQQQQIIQQ")
            self.dyn = struct.Struct(e + "qQ")
            self.sym = struct.Struct(e + "IBBHQQ")
            self.sym_fields = lambda s: (s[0], s[1], s[3])  # name, info, shndx
        else:
            self.header = struct.Struct(e + "HHIIIIIHHHHHH")
            self.section = struct.Struct(e + "IIIIIIIIII")
            self.dyn = struct.Struct(e + "iI")
            self.sym = struct.Struct(e + "IIIBBH")
            self.sym_fields = lambda s: (s[0], s[3], s[5])


def _read(f: BinaryIO, offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise ValueError(f"truncated ELF: wanted {size} bytes at offset {offset}, got {len(data)}")
    return data


def _string(table: bytes, offset: int) -> str:
    end = table.find(b"\0", offset)
    return table[offset:end if end >= 0 else len(table)].decode("utf-8", "replace")


def read_dynamic(f: BinaryIO) -> DynamicInfo | None:
    """The library's NEEDED entries and undefined dynamic symbols; ``None`` when ``f`` is not an
    ELF file or has no section headers to find them by. Raises ``ValueError`` on a truncated or
    inconsistent file."""
    ident = _read(f, 0, 16) if _peek_magic(f) else None
    if ident is None or ident[4] not in (1, 2) or ident[5] not in (1, 2):
        return None
    lay = _Layout(is64=ident[4] == 2, little=ident[5] == 1)
    hdr = lay.header.unpack(_read(f, 16, lay.header.size))
    shoff, shentsize, shnum = hdr[5], hdr[10], hdr[11]
    if shoff == 0 or shentsize < lay.section.size:
        return None
    if shnum == 0:  # more than 0xff00 sections: the count lives in section 0's sh_size
        shnum = lay.section.unpack(_read(f, shoff, lay.section.size))[5]
    sections = [lay.section.unpack(_read(f, shoff + i * shentsize, lay.section.size)) for i in range(shnum)]

    def body(section: tuple) -> bytes:
        return _read(f, section[4], section[5])  # sh_offset, sh_size

    needed, undefined = [], []
    for s in sections:
        kind, link, entsize = s[1], s[6], s[9]
        if kind == _SHT_DYNAMIC and link < shnum:
            strings, table = body(sections[link]), body(s)
            step = entsize or lay.dyn.size
            for off in range(0, len(table) - lay.dyn.size + 1, step):
                tag, val = lay.dyn.unpack_from(table, off)
                if tag == _DT_NULL:
                    break
                if tag == _DT_NEEDED:
                    needed.append(_string(strings, val))
        elif kind == _SHT_DYNSYM and link < shnum:
            strings, table = body(sections[link]), body(s)
            step = entsize or lay.sym.size
            for off in range(step, len(table) - lay.sym.size + 1, step):  # entry 0 is the null symbol
                name, info, shndx = lay.sym_fields(lay.sym.unpack_from(table, off))
                if shndx == _SHN_UNDEF and name and info >> 4 != _STB_WEAK:
                    undefined.append(_string(strings, name))
    return DynamicInfo(tuple(needed), tuple(undefined))


def _peek_magic(f: BinaryIO) -> bool:
    f.seek(0)
    return f.read(4) == _MAGIC
